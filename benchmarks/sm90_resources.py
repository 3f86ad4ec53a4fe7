"""What Triton compiles for a GPU, on a machine without one: registers, spills, shared memory and
the wgmma instructions (shape, and whether the left operand comes from registers) of each kernel
launch of one stage, with the launch settings kernels/tiling.py picks on that GPU.

    PYTHONPATH=. python benchmarks/sm90_resources.py --stage bob --d 128
    PYTHONPATH=. python benchmarks/sm90_resources.py --stage bob --d 128 \\
        --settings '{"bob_rows": {"PK_LATE": true, "DO_IN_REGS": true, "Q_IN_REGS": true}}'
    PYTHONPATH=. python benchmarks/sm90_resources.py --stage forward --d 128 --key-range
    PYTHONPATH=. python benchmarks/sm90_resources.py --stage bob --d 128 --dtype fp32 --fp32-precision tf32x3

It calls the stage's launcher in kernels.triton_ops on small CPU tensors, with every kernel launch
replaced by a compile for the target (`triton.compile` with a `GPUTarget`: nothing runs, so no
output is computed), and prints one JSON line per compiled launch: the kernel, its compile-time
flags, tiles, warps and stages; registers, stack bytes and the spill stores / loads in its SASS
(`cuobjdump`, shipped with Triton); shared memory; its HGMMA instructions by shape, "SS" with both
operands in shared memory, "RS" with the left one in registers; and its TMA copies
(`cp.async.bulk.tensor` in the PTX: tensor-descriptor loads, the TMA_LOADS setting). Needs Triton's
NVIDIA backend (Triton 3.6: the launch path it repeats is `JITFunction.run`'s) and must run without
TRITON_INTERPRET. Strides
and alignment specialize as on the GPU for contiguous inputs; lengths do not specialize at all
(`kernels._tiles.NO_SPECIALIZE`), so the small sizes compile what long sequences run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernels import tiling, triton_ops, validation

STAGE_KERNELS = {"forward": ("forward",), "backward": ("backward_kv", "backward_q"),
                 "bob": ("bob_rows", "bob_cols"), "jvp": ("jvp",)}
FLAGS = ("CAUSAL", "HAS_RANGE", "WANT_GQ", "WANT_GDO", "PK_LATE", "DO_IN_REGS", "Q_IN_REGS", "KEYS_IN_REGS",
         "TMA_LOADS")
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def cuobjdump(cubin: bytes, *options: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), *options, f.name], capture_output=True,
                              text=True, check=True).stdout


def describe(compiled, kwargs: dict) -> dict:
    """One launch's row: flags, tiles, and what the compiled kernel holds."""
    usage = cuobjdump(compiled.asm["cubin"], "--dump-resource-usage")
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    hgmma = collections.Counter(
        f"{shape} {'RS' if a.startswith('R') else 'SS'}"
        for shape, a in re.findall(r"HGMMA\.(\d+x\d+x\d+)\S*\s+\S+,\s*(\S+)", sass))
    return {"kernel": compiled.metadata.name, **{k: kwargs[k] for k in FLAGS if k in kwargs},
            **{k: kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "num_warps", "num_stages",
                                          "maxnreg")},
            "regs": regs, "stack_bytes": stack, "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            "spill_loads": len(re.findall(r"\bLDL\b", sass)), "shared_bytes": compiled.metadata.shared,
            "hgmma": dict(sorted(hgmma.items())),
            "tma_copies": len(re.findall(r"cp\.async\.bulk\.tensor", compiled.asm["ptx"]))}


class CompileOnly:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` compiles for `target`
    the way a launch would (same specialization and options), records the row and returns the
    compiled kernel (whose metadata the launchers read) without running it."""

    def __init__(self, fn, target: GPUTarget, rows: list):
        self.fn, self.target, self.rows = fn, target, rows

    def __getitem__(self, grid):
        def compile_launch(*args, **kwargs):
            backend = make_backend(self.target)
            binder = create_function_from_signature(self.fn.signature, self.fn.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = self.fn._pack_args(
                backend, kwargs, bound, specialization, options)
            source = ASTSource(self.fn, signature, constexprs, attrs)
            compiled = triton.compile(source, target=self.target, options=options.__dict__)
            self.rows.append(describe(compiled, kwargs))
            return compiled

        return compile_launch


@contextlib.contextmanager
def compile_only(target: GPUTarget, rows: list):
    """Within the block, every kernel the launchers in kernels.triton_ops start is compiled only."""
    names = [name for name in vars(triton_ops) if name.endswith("_kernel")]
    real = {name: getattr(triton_ops, name) for name in names}
    for name in names:
        setattr(triton_ops, name, CompileOnly(real[name], target, rows))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(triton_ops, name, fn)


def device_settings(stage: str, d: int, dtype: torch.dtype, limits: tiling.DeviceLimits, given: dict,
                    precision: str = "tf32"):
    """tiling.override for every kernel of the stage: the tiles `tiling.cuda_config` picks on a
    device with `limits` for products of `precision` (triton_ops' input_precision), updated by the
    given {kernel: settings}."""
    stack = contextlib.ExitStack()
    itemsize = torch.empty((), dtype=dtype).element_size()
    for kernel in STAGE_KERNELS[stage]:
        cfg = tiling.cuda_config(kernel, d, itemsize, limits, precision)
        cfg.pop("BLOCK_D")
        stack.enter_context(tiling.override(kernel, **{**cfg, **given.get(kernel, {})}))
    return stack


def run_stage(stage: str, d: int, dtype: torch.dtype, causal: bool, key_range: bool,
              fp32_precision: str | None = None) -> None:
    """Call the stage's launcher on small CPU inputs (B=1, H=2, N=M=64)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout, u_q, u_k, u_v = (torch.randn(1, 2, 64, d, generator=gen).to(dtype) for _ in range(7))
    opts = dict(causal=causal, window=None, scale=d**-0.5, fp32_precision=fp32_precision,
                key_range=torch.tensor([[0, 64]], dtype=torch.int32) if key_range else None)
    lse = torch.zeros(1, 2, 64)
    if stage == "forward":
        triton_ops.forward(q, k, v, **opts)
    elif stage == "backward":
        triton_ops.backward(q, k, v, q, lse, dout, **opts)
    elif stage == "bob":
        triton_ops.bob(q, k, v, q, lse, dout, q, u_q, u_k, u_v, **opts)
    else:
        triton_ops.jvp(q, k, v, u_q, u_k, u_v, **opts)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=sorted(STAGE_KERNELS), default="bob")
    p.add_argument("--d", type=int, default=128, help="head dim")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--mask", choices=("causal", "full"), default="causal")
    p.add_argument("--key-range", action="store_true", help="compile the key-range path (HAS_RANGE)")
    p.add_argument("--settings", default="{}", help='JSON {kernel: tiling.override settings}')
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80")
    p.add_argument("--shared-mem", default="227K", help="the device's shared memory per block")
    p.add_argument("--fp32-precision", choices=validation.FP32_PRECISIONS, default=None,
                   help="products of float32 inputs (default: validation.DEFAULT_FP32_PRECISION)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("benchmarks/sm90_resources.py compiles kernels: unset TRITON_INTERPRET")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    limits = tiling.DeviceLimits(tiling.parse_shared_mem(args.shared_mem), divmod(args.arch, 10))
    precision = validation.check_fp32_precision(args.fp32_precision) if dtype == torch.float32 else "tf32"
    rows: list[dict] = []
    with device_settings(args.stage, args.d, dtype, limits, json.loads(args.settings), precision), \
            compile_only(GPUTarget("cuda", args.arch, 32), rows):
        run_stage(args.stage, args.d, dtype, args.mask == "causal", args.key_range, args.fp32_precision)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
