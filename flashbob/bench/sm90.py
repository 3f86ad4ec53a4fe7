"""What Triton compiles for a GPU, on a machine without one: registers, spills, shared memory and
the wgmma instructions (shape, and whether the left operand comes from registers) of each kernel
launch of one stage, with the launch settings flashbob/tiling.py picks on that GPU.

    python -m flashbob.bench sm90 --stage bob --d 128
    python -m flashbob.bench sm90 --stage bob --d 128 --settings '{"bob_cols": {"num_warps": 4}}'
    python -m flashbob.bench sm90 --stage bob --d 64 --tree HEAD~1
    python -m flashbob.bench sm90 --stage forward --d 128 --key-range
    python -m flashbob.bench sm90 --stage bob --d 128 --dtype fp32 --fp32-precision tf32x3

It calls the stage's launcher in flashbob.triton_ops on small CPU tensors, with every kernel launch
replaced by a compile for the target (`triton.compile` with a `GPUTarget`: nothing runs, so no
output is computed), and prints one JSON line per compiled launch: the kernel, its compile-time
flags, tiles, warps and stages; registers, stack bytes and the spill stores / loads in its SASS
(`cuobjdump`, shipped with Triton); its SASS instruction count and a hash of the instructions (two
versions compile the same code where the hashes agree); shared memory next to
`tiling.shared_mem_estimate` (the estimate must meet it: recalibrate the estimate where it does not);
and its HGMMA instructions by shape, "SS" with both operands in shared memory, "RS" with the left one
in registers. Needs Triton's
NVIDIA backend (Triton 3.6: the launch path it repeats is `JITFunction.run`'s) and must run without
TRITON_INTERPRET. Strides
and alignment specialize as on the GPU for contiguous inputs; lengths do not specialize at all
(`flashbob._tiles.NO_SPECIALIZE`), so the small sizes compile what long sequences run. --tree compiles
another version's kernels (a directory or commit, as `ab` takes them) with this tree's settings: where
its sass_hash equals this tree's, the two run the same code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from flashbob import tiling, triton_ops, validation
from flashbob.bench import DTYPES

STAGE_KERNELS = {"forward": ("forward",), "backward": ("backward_kv", "backward_q"),
                 "bob": ("bob_rows", "bob_cols"), "jvp": ("jvp",)}
FLAGS = ("CAUSAL", "HAS_RANGE", "WANT_GQ", "WANT_GDO", "LATE_PK")
KERNEL_OF = {"attention_forward_kernel": "forward", "attention_forward_split_kernel": "forward_split",
             "attention_backward_dkdv_kernel": "backward_kv",
             "attention_backward_dq_kernel": "backward_q", "attention_bob_rows_kernel": "bob_rows",
             "attention_bob_cols_kernel": "bob_cols", "attention_jvp_kernel": "jvp"}
"""Compiled kernel name -> its `tiling` name (row_dot and the forward's combine have none: no tiles to
estimate)."""
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def cuobjdump(cubin: bytes, *options: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(TOOLS, "cuobjdump"), *options, f.name], capture_output=True,
                              text=True, check=True).stdout


def sass_instructions(sass: str) -> list[str]:
    """The instructions of a SASS listing without addresses, encodings and parameter offsets (which
    move when a kernel's argument list changes)."""
    found = re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]*);", sass)
    return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][.]", line.strip()) for line in found]


def estimate(name: str, kwargs: dict, itemsize: int) -> int | None:
    """tiling.shared_mem_estimate of the launch (None for a kernel without tiles)."""
    kernel = KERNEL_OF.get(name)
    if kernel is None:
        return None
    flags = {k: v for k, v in kwargs.items() if k.startswith("HAS_")}
    return tiling.shared_mem_estimate(kernel, kwargs, itemsize, kwargs.get("PRECISION", "ieee"), **flags)


def describe(compiled, kwargs: dict, itemsize: int = 2) -> dict:
    """One launch's row: flags, tiles, and what the compiled kernel holds."""
    usage = cuobjdump(compiled.asm["cubin"], "--dump-resource-usage")
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    sass = cuobjdump(compiled.asm["cubin"], "-sass")
    instructions = sass_instructions(sass)
    hgmma = collections.Counter(
        f"{shape} {'RS' if a.startswith('R') else 'SS'}"
        for shape, a in re.findall(r"HGMMA\.(\d+x\d+x\d+)\S*\s+\S+,\s*(\S+)", sass))
    return {"kernel": compiled.metadata.name, **{k: kwargs[k] for k in FLAGS if k in kwargs},
            **{k: kwargs.get(k) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "num_warps", "num_stages",
                                          "STAGES", "maxnreg")},
            "regs": regs, "stack_bytes": stack, "spill_stores": len(re.findall(r"\bSTL\b", sass)),
            "spill_loads": len(re.findall(r"\bLDL\b", sass)), "instructions": len(instructions),
            "sass_hash": hashlib.sha1("\n".join(instructions).encode()).hexdigest()[:12],
            "shared_bytes": compiled.metadata.shared,
            "estimate_bytes": estimate(compiled.metadata.name, kwargs, itemsize),
            "hgmma": dict(sorted(hgmma.items()))}


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
            source_type = GluonASTSource if self.fn.is_gluon() else ASTSource
            source = source_type(self.fn, signature, constexprs, attrs)
            compiled = triton.compile(source, target=self.target, options=options.__dict__)
            first = getattr(args[0], "base", args[0])   # a Gluon kernel's first argument: a TMA descriptor
            self.rows.append(describe(compiled, kwargs, first.element_size()))
            return compiled

        return compile_launch


@contextlib.contextmanager
def compile_only(target: GPUTarget, rows: list, ops=triton_ops):
    """Within the block, every kernel the launchers in `ops` (flashbob.triton_ops, or another tree's
    copy) start is compiled only."""
    hopper = sys.modules.get(ops.__name__.rpartition(".")[0] + ".hopper")   # absent in older trees
    patched = [(ops, name) for name in vars(ops) if name.endswith("_kernel")]
    if hopper is not None:
        patched += [(hopper, name) for name in vars(hopper) if name.endswith("_kernel")]
        patched.append((hopper, "on_hopper"))
    real = [(module, name, getattr(module, name)) for module, name in patched]
    for module, name, fn in real:
        stand_in = (lambda q: target.arch == 90) if name == "on_hopper" else CompileOnly(fn, target, rows)
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for module, name, fn in real:
            setattr(module, name, fn)


def device_settings(stage: str, d: int, dtype: torch.dtype, limits: tiling.DeviceLimits, given: dict,
                    precision: str = "tf32", override=tiling.override):
    """`override` (tiling.override, or another tree's) for every kernel of the stage: the tiles this
    tree's `tiling.cuda_config` picks on a device with `limits` for products of `precision`
    (triton_ops' input_precision), updated by the given {kernel: settings}."""
    stack = contextlib.ExitStack()
    itemsize = torch.empty((), dtype=dtype).element_size()
    for kernel in STAGE_KERNELS[stage]:
        cfg = tiling.cuda_config(kernel, d, itemsize, limits, precision)
        cfg.pop("BLOCK_D")
        stack.enter_context(override(kernel, **{**cfg, **given.get(kernel, {})}))
    return stack


def run_stage(stage: str, d: int, dtype: torch.dtype, causal: bool, key_range: bool,
              fp32_precision: str | None = None, ops=triton_ops, n: int = 64) -> None:
    """Call the stage's launcher in `ops` on small CPU inputs (B=1, H=2, N=M=n; n a multiple of 16
    compiles what lengths divisible by 16 run in versions that specialize on lengths). Options left
    at their defaults are not passed (older launchers do not take them)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout, u_q, u_k, u_v = (torch.randn(1, 2, n, d, generator=gen).to(dtype) for _ in range(7))
    opts = dict(causal=causal, window=None, scale=d**-0.5)
    if fp32_precision is not None:
        opts["fp32_precision"] = fp32_precision
    if key_range:
        opts["key_range"] = torch.tensor([[0, n]], dtype=torch.int32)
    lse = torch.zeros(1, 2, n)
    if stage == "forward":
        ops.forward(q, k, v, **opts)
    elif stage == "backward":
        ops.backward(q, k, v, q, lse, dout, **opts)
    elif stage == "bob":
        ops.bob(q, k, v, q, lse, dout, q, u_q, u_k, u_v, **opts)
    else:
        ops.jvp(q, k, v, u_q, u_k, u_v, **opts)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m flashbob.bench sm90", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--tree", default=None,
                   help="compile another version's kernels with this tree's settings: a directory holding "
                        "flashbob/ or a commit (as in `python -m flashbob.bench ab`); compare sass_hash")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("python -m flashbob.bench sm90 compiles kernels: unset TRITON_INTERPRET")
    dtype = DTYPES[args.dtype]
    ops, override = triton_ops, tiling.override
    if args.tree:
        from flashbob.bench import ab

        ops = ab.import_side(ab.resolve(args.tree), "flashbob_sm90_tree")
        override = sys.modules["flashbob_sm90_tree.tiling"].override
    limits = tiling.DeviceLimits(tiling.parse_shared_mem(args.shared_mem), divmod(args.arch, 10))
    precision = validation.check_fp32_precision(args.fp32_precision) if dtype == torch.float32 else "tf32"
    rows: list[dict] = []
    with device_settings(args.stage, args.d, dtype, limits, json.loads(args.settings), precision, override), \
            compile_only(GPUTarget("cuda", args.arch, 32), rows, ops):
        run_stage(args.stage, args.d, dtype, args.mask == "causal", args.key_range, args.fp32_precision, ops)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
