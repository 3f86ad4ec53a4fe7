"""transformers tests: skipped without transformers; registers attn_implementation "bob" (auto
backend: torch on the CPU) and "bob_triton" (the Triton kernels; the interpreter on the CPU)."""

import pytest

pytest.importorskip("transformers")

import kernels  # noqa: E402

kernels.register_transformers("bob")
kernels.register_transformers("bob_triton", backend="triton")
