"""Test-wide setup. Without a GPU the Triton kernels run in Triton's CPU interpreter, which must be
switched on before triton is first imported."""

import glob
import os

if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
