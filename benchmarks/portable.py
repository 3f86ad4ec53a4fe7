"""Issue 13 measurements on one GPU, in one command, each part under its own time budget:

    PYTHONPATH=. python benchmarks/portable.py --out portable_out

Parts, in order of importance (a part starts no new case once its budget is spent, and records
the cases it skipped; a failing case is recorded and the run goes on):
  sweep       BoB launch settings for bob_rows / bob_cols (tiling.override; SWEEP), bf16, B=1,
              H=8, N=16384, head dims 128 and 64: every setting causal (then the best rows and the
              best cols setting together, where both beat the default), then the default and the
              causal winner full. Per setting: median ms of the second-order call
              (triton.testing.do_bench), ratio to torch's flash forward+backward measured in the same
              run, GPU ms of the rows and the columns kernels (profiler), relative difference of the
              four outputs to the default setting's, the worst error of the four at N=--n-check
              against float64 as a multiple of plain PyTorch's in bf16, bitwise determinism on
              repeat, and the first call's seconds (its compilation).
  ranges      the forward with key ranges that mask nothing against the forward without (B=4, d 128
              and 64), through the launcher and through flash_attention, alternating.
  precision   float32 products (fp32_precision tf32x3, tf32, then ieee; --precision-modes), N=4096,
              causal, head dims 64 and 128: relative error against float64 of out, dq, dk, dv and
              the four BoB outputs (B=1, H=2), next to plain PyTorch float32's error (TF32 off); and
              the ms of forward + backward and of the BoB (B=1, H=8), with bf16's for scale. With
              --precision-settings, each float32 mode runs under each named launch setting of
              FP32_SETTINGS (e.g. the settings of an older commit next to the default).
  first_call  one fresh process per (dtype, head dim, mask, GQA) family (4 side by side), with an
              empty Triton cache (TRITON_CACHE_DIR a new directory): seconds to the first forward,
              backward and BoB; then a call at N+1 in the (B, N, H, D) layout (other divisibility
              of lengths and strides) and the number of kernels it compiled (0 wanted). Float32
              families run once per --first-call-settings name (FP32_SETTINGS). Each row says
              whether kernels.precompile compiled the kernels side by side first (precompile;
              FLASHBOB_PRECOMPILE=0 in the environment turns it off, for a before / after).
  shared      free, from the launches above: each compiled kernel's shared memory against
              kernels.tiling.shared_mem_estimate (to recalibrate the estimate), its registers and
              spills (of a split rows kernel: the launch with the larger shared memory).
Writes OUT/results.csv and OUT/results.jsonl (every row) after each row and prints a short table
last. --smoke runs every part at toy sizes, float16 standing in for bfloat16 (on the CPU under
TRITON_INTERPRET=1: a test of the script).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import kernels
from kernels import precompile, tiling
from kernels.environment import commit
from kernels.reference import attention_naive

TMA_SETTINGS = [  # tensor-descriptor (TMA) loads in one BoB kernel (kernel_notes.md, TMA; warp-specialised
    # loops were measured wrong on an H200 with Triton 3.6 and are not offered)
    ("rows TMA", {"bob_rows": dict(TMA_LOADS=True)}),
    ("cols TMA", {"bob_cols": dict(TMA_LOADS=True)}),
]
SWEEP = {  # head dim 128 first: the larger gap to its goal. (name, {kernel: tiling.override settings}),
    # in the order of their chances (docs/kernel_notes.md, 2026-12-01): a budget cut drops the last ones
    128: [
        ("default", {}),
        *TMA_SETTINGS,
        # 128 rows over two warpgroups (64 each: no cross-warpgroup row sums, half the key-side loads
        # per product), sum P K in the dO launch, every left operand in registers (no spills on sm_90)
        ("rows 128x32 w8, P K late, all in regs", {"bob_rows": dict(
            BLOCK_M=128, num_warps=8, PK_LATE=True, DO_IN_REGS=True, Q_IN_REGS=True, Q_IN_REGS_GQ=True)}),
        # the columns kernel with k, v, u_k, u_v in registers (all five recomputes read one operand
        # from shared memory; 24 B of spills on sm_90)
        ("cols keys in regs", {"bob_cols": dict(KEYS_IN_REGS=True)}),
        # the same rows change at the default 64 x 32 tile (two programs per SM, not one)
        ("rows P K late, all in regs",
         {"bob_rows": dict(PK_LATE=True, DO_IN_REGS=True, Q_IN_REGS=True, Q_IN_REGS_GQ=True)}),
        ("rows 128x32 w8 s3, P K late, all in regs", {"bob_rows": dict(
            BLOCK_M=128, num_warps=8, num_stages=3, PK_LATE=True, DO_IN_REGS=True, Q_IN_REGS=True,
            Q_IN_REGS_GQ=True)}),
        # the parts alone: q and u_q in registers in the dO launch; the 128-row tile; P K in the dO
        # launch (the Q-bar launch stops spilling); one more columns stage
        ("rows q in regs", {"bob_rows": dict(Q_IN_REGS=True)}),
        ("rows 128x32 w8", {"bob_rows": dict(BLOCK_M=128, num_warps=8)}),
        ("rows P K late", {"bob_rows": dict(PK_LATE=True)}),
        ("cols 3 stages", {"bob_cols": dict(num_stages=3)}),
    ],
    64: [
        ("default", {}),
        *TMA_SETTINGS,
        # one rows launch with dO, q and u_q in registers (239 registers, fewer than the default's 246)
        ("rows dO + q in regs", {"bob_rows": dict(DO_IN_REGS=True, Q_IN_REGS=True)}),
        # the default 64 x 64 columns tile spills 128 B on sm_90; with the keys in registers, none
        ("cols keys in regs", {"bob_cols": dict(KEYS_IN_REGS=True)}),
        # the head-dim-128 columns tile (128 keys over two warpgroups)
        ("cols 32x128 w8, keys in regs",
         {"bob_cols": dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, KEYS_IN_REGS=True)}),
        ("rows 128x32 w8, dO + q in regs",
         {"bob_rows": dict(BLOCK_M=128, num_warps=8, DO_IN_REGS=True, Q_IN_REGS=True)}),
        ("cols 32x128 w8", {"bob_cols": dict(BLOCK_M=32, BLOCK_N=128, num_warps=8)}),
    ],
}
"""After the causal settings of a head dim, the best rows-only and the best cols-only setting that
beat the default are also measured together; full attention then runs the default and the best.
Each head dim gets a share of the sweep's budget in proportion to its settings plus those three,
and its causal settings leave the three their part of it."""
FAMILIES = [  # [dtype, head dim, mask, kv heads of 4 query heads, fp32_precision]
    ["bf16", 64, "causal", 4, None],
    ["bf16", 128, "full", 1, None],
    ["fp32", 64, "causal", 4, None],
    ["fp16", 256, "causal", 4, None],
    ["fp32", 128, "causal", 2, "tf32x3"],
    ["bf16", 80, "window", 2, None],
    ["fp32", 64, "causal", 4, "tf32"],
]
NO_REGISTER_CAP = {kernel: {"maxnreg": None} for kernel in tiling.KERNELS}
FP32_SETTINGS = {  # head dim family (64: up to 64, 128: above) -> [(name, {kernel: override settings})]
    # float32 tf32x3 at head dim 128 (docs/kernel_notes.md, 2026-12-01): the default caps registers
    # at 255 and takes kernels.tiling.TF32X3_HEAD_DIM_128 (32-wide loop tiles in the forward and first
    # backward, 16 x 16 BoB columns tiles), the fastest measured at 9466ba6; "9466ba6" is the launch
    # before the tiles, "f4c7a04" the launch before the register cap too
    128: [
        ("default", {}),
        *TMA_SETTINGS,
        ("9466ba6", {"forward": dict(BLOCK_N=64, num_stages=2), "backward_kv": dict(BLOCK_M=64, num_stages=1),
                     "backward_q": dict(BLOCK_N=64, num_stages=1), "bob_cols": dict(BLOCK_N=32)}),
        ("f4c7a04", {**NO_REGISTER_CAP, "forward": dict(maxnreg=None, BLOCK_N=64, num_stages=2),
                     "backward_kv": dict(maxnreg=None, BLOCK_M=64, num_stages=1),
                     "backward_q": dict(maxnreg=None, BLOCK_N=64, num_stages=1),
                     "bob_cols": dict(maxnreg=None, BLOCK_N=32, num_stages=1)}),
        ("cols 1 stage", {"bob_cols": dict(num_stages=1)}),
        ("cols 32x32 w8", {"bob_cols": dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=1)}),
    ],
    64: [
        ("default", {}),
        *TMA_SETTINGS,
        ("f4c7a04", NO_REGISTER_CAP),
    ],
}
"""Launch settings of the float32 precision and first-call parts, tried in list order across head
dims (a budget cut drops the last ones); applied to float32 inputs only."""


def fp32_settings(d: int, name: str) -> dict | None:
    """{kernel: settings} of FP32_SETTINGS' `name` for head dim d (None if it has no such entry)."""
    return dict(FP32_SETTINGS[64 if d <= 64 else 128]).get(name)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KERNEL_FNS = ("attention_forward_kernel", "attention_backward_dkdv_kernel", "attention_backward_dq_kernel",
              "attention_bob_rows_kernel", "attention_bob_cols_kernel", "row_dot_kernel")


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def free_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_ms(fn, rep_ms: int) -> float:
    """Median ms of fn (triton.testing.do_bench on CUDA; one timed call elsewhere)."""
    if not torch.cuda.is_available():
        return 1e3 * seconds(fn)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=min(50, rep_ms // 4), rep=rep_ms, return_mode="median"))


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def random_inputs(b, h_q, h_kv, n, d, dtype, seed=0, layout="bhnd"):
    """q, dout, u_q (b, h_q, n, d); k, v, u_k, u_v (b, h_kv, n, d); as (B, N, H, D) storage if asked."""
    gen = torch.Generator(device=device()).manual_seed(seed)

    def make(h):
        shape = (b, n, h, d) if layout == "bnhd" else (b, h, n, d)
        t = torch.randn(shape, device=device(), dtype=torch.float64, generator=gen).to(dtype)
        return t.transpose(1, 2) if layout == "bnhd" else t

    return [make(h) for h in (h_q, h_kv, h_kv, h_q, h_q, h_kv, h_kv)]


def mask_options(mask: str) -> dict:
    return {"full": dict(causal=False, window=None), "causal": dict(causal=True, window=None),
            "window": dict(causal=True, window=64)}[mask]


def all_orders(attention, q, k, v, dout, u_q, u_k, u_v):
    """out, (dq, dk, dv) and the BoB outputs through autograd, for an attention callable."""
    q, k, v, dout = (t.detach().clone().requires_grad_() for t in (q, k, v, dout))
    out = attention(q, k, v)
    firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    bob = torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v))
    return [out.detach(), *(f.detach() for f in firsts), *bob]


def bob_call(attention, q, k, v, dout, u_q, u_k, u_v):
    """The second-order call alone (graph built once), as a closure."""
    q, k, v, dout = (t.detach().requires_grad_() for t in (q, k, v, dout))
    firsts = torch.autograd.grad(attention(q, k, v), (q, k, v), dout, create_graph=True)
    return lambda: torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v), retain_graph=True)


def fwd_bwd_call(attention, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout)


def ours(mask: str, fp32_precision=None):
    opts = mask_options(mask)
    def attention(q, k, v):
        return kernels.flash_attention(q, k, v, **opts, backend="triton", fp32_precision=fp32_precision)

    return attention


def torch_flash(mask: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if torch.cuda.is_available() else SDPBackend.MATH

    def attention(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=mask != "full")

    return attention


class Run:
    """Rows, budgets and output files of one invocation."""

    def __init__(self, args):
        self.args, self.rows = args, []
        os.makedirs(args.out, exist_ok=True)

    def record(self, part: str, **fields) -> None:
        row = {"part": part, **fields}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.save()  # a run cut off by a time limit keeps every row recorded so far

    def save(self) -> None:
        names = list(dict.fromkeys(k for row in self.rows for k in row))
        with open(os.path.join(self.args.out, "results.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        with open(os.path.join(self.args.out, "results.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in self.rows)


def failure(exc: BaseException) -> str:
    return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def overrides(settings: dict):
    """A context that applies {kernel: settings} through tiling.override."""
    stack = contextlib.ExitStack()
    for kernel, values in settings.items():
        stack.enter_context(tiling.override(kernel, **values))
    return stack


def bob_outputs(mask: str, d: int, inputs) -> list[torch.Tensor]:
    """The four BoB outputs of flash_attention on inputs (q, k, v, dout, u_q, u_k, u_v)."""
    q, k, v, dout, u_q, u_k, u_v = inputs
    return list(bob_call(ours(mask), q, k, v, dout, u_q, u_k, u_v)())


class SmallCheck:
    """Error of a setting's BoB at a small size (B=1, H=2, --n-check) against float64, as a multiple
    of plain PyTorch's error in the same low precision (worst of the four outputs): the compiled
    kernels are the ones timed (lengths do not specialize)."""

    def __init__(self, a, d: int, mask: str):
        full = random_inputs(1, 2, 2, a.n_check, d, torch.float64, seed=3)
        self.low = [t.to(DTYPES[a.low]) for t in full]
        opts = mask_options(mask)

        def naive(q, k, v):
            return attention_naive(q, k, v, causal=opts["causal"], window=opts["window"], scale=d**-0.5)

        self.ref = all_orders(naive, *full)[4:]
        self.torch_err = [rel(x, r) for x, r in zip(all_orders(naive, *self.low)[4:], self.ref)]
        self.mask, self.d = mask, d

    def worst_ratio(self) -> float:
        got = bob_outputs(self.mask, self.d, self.low)
        return max(rel(x, r) / max(e, 1e-30) for x, r, e in zip(got, self.ref, self.torch_err))


def kernel_split(bob) -> dict:
    """GPU ms per call of the BoB rows and columns kernels (both rows launches summed); {} off CUDA."""
    if not torch.cuda.is_available():
        return {}
    from kernels.bench import kernel_times

    names = {"rows_ms": "attention_bob_rows_kernel", "cols_ms": "attention_bob_cols_kernel"}
    times = kernel_times(bob, list(names.values()), reps=3)
    return {key: times[name] for key, name in names.items()}


def best_combination(rows: list[dict], d: int) -> tuple | None:
    """The best causal rows-only and cols-only settings at d that beat the default, together."""
    done = [r for r in rows if r["part"] == "sweep" and r.get("part_d") == d and r["mask"] == "causal"
            and r["status"] == "ok"]
    default = next((r["ms"] for r in done if r["setting"] == "default"), None)
    best = {}
    for r in done:
        kernels_ = tuple(json.loads(r["override"]))
        better = default is not None and len(kernels_) == 1 and r["ms"] < default
        if better and (kernels_[0] not in best or r["ms"] < best[kernels_[0]]["ms"]):
            best[kernels_[0]] = r
    if set(best) != {"bob_rows", "bob_cols"}:
        return None
    name = " + ".join(best[k]["setting"] for k in ("bob_rows", "bob_cols"))
    return name, {k: json.loads(best[k]["override"])[k] for k in ("bob_rows", "bob_cols")}


class SweepCase:
    """One (head dim, mask) of the sweep: its inputs, flash's time, the BoB call and the small
    float64 check, and `measure`, which records one setting's row."""

    def __init__(self, run: Run, d: int, mask: str):
        a = run.args
        self.run, self.d, self.mask, self.reference = run, d, mask, None
        q, k, v, dout, u_q, u_k, u_v = random_inputs(1, a.heads, a.heads, a.n_sweep, d, DTYPES[a.low])
        self.flash_ms = median_ms(fwd_bwd_call(torch_flash(mask), q, k, v, dout), a.rep_ms)
        self.bob = bob_call(ours(mask), q, k, v, dout, u_q, u_k, u_v)
        self.check = SmallCheck(a, d, mask)

    def measure(self, name: str, override: dict, deadline: float) -> None:
        base = dict(part_d=self.d, mask=self.mask, setting=name, override=json.dumps(override),
                    flash_ms=self.flash_ms)
        if time.monotonic() > deadline:
            self.run.record("sweep", **base, status="skipped: budget")
            return
        bob = self.bob
        try:
            with overrides(override):
                first_s = seconds(bob)
                got = bob()
                again = bob()
                ms = median_ms(bob, self.run.args.rep_ms)
                split = kernel_split(bob)
                err_ratio = self.check.worst_ratio()
            deterministic = all(torch.equal(x, y) for x, y in zip(got, again))
            if self.reference is None:
                self.reference = got
            diff = max(rel(x, y) for x, y in zip(got, self.reference))
            good = diff < 2e-2 and deterministic and err_ratio < 1
            self.run.record("sweep", **base, ms=ms, ratio=ms / self.flash_ms, rel_diff_to_default=diff,
                            deterministic=deterministic, err_ratio_to_torch=err_ratio, **split,
                            first_call_s=first_s, status="ok" if good else "WRONG?")
        except Exception as exc:  # a setting may not compile or fit: record it and go on
            self.run.record("sweep", **base, status=failure(exc))


def part_sweep(run: Run, budget: float) -> None:
    a = run.args
    start = time.monotonic()
    shares = {d: len(settings[:a.settings]) + 3 for d, settings in SWEEP.items()}
    deadline = start
    for d, settings in SWEEP.items():
        settings = settings[:a.settings]
        share = budget * shares[d] / sum(shares.values())
        # the causal settings leave the last 3 / (settings + 3) of the share to the combination and full
        causal_deadline = deadline + share * len(settings) / shares[d]
        deadline += share
        case = SweepCase(run, d, "causal")
        for name, override in settings:
            case.measure(name, override, causal_deadline)
        combination = best_combination(run.rows, d)
        if combination is not None:
            case.measure(*combination, deadline)
        ok = [r for r in run.rows if r["part"] == "sweep" and r.get("part_d") == d and r.get("ms")
              and r["mask"] == "causal" and r["status"] == "ok"]
        best = min(ok, key=lambda r: r["ms"], default=None)
        del case
        free_memory()
        case = SweepCase(run, d, "full")
        case.measure("default", {}, deadline)
        if best and best["setting"] != "default":
            case.measure(best["setting"], json.loads(best["override"]), deadline)
        del case
        free_memory()


def range_calls(a, d: int, batch: int) -> dict:
    """{(path, setting): forward call} of the ranges part at head dim d."""
    from kernels import triton_ops

    q, k, v = random_inputs(batch, a.heads, a.heads, a.n_sweep, d, DTYPES[a.low])[:3]
    starts = torch.zeros(batch, dtype=torch.int32, device=device())
    ranges = {"none": {}, "full": {"key_start": starts, "key_end": starts + a.n_sweep}}
    key_range = {"none": None, "full": torch.stack((starts, starts + a.n_sweep), -1)}
    calls = {}
    for setting in ("none", "full"):
        calls[("launcher", setting)] = lambda kr=key_range[setting]: triton_ops.forward(
            q, k, v, causal=True, window=None, scale=d**-0.5, key_range=kr)
        calls[("flash_attention", setting)] = lambda r=ranges[setting]: kernels.flash_attention(
            q, k, v, causal=True, backend="triton", **r)
    return calls


def part_ranges(run: Run, budget: float) -> None:
    """The forward with key ranges that mask nothing (key_start 0, key_end N: the "full" setting of
    benchmarks/key_ranges.py) against the forward without, causal, bf16, B=4, H=8, N=--n-sweep, head
    dims 128 and 64 (docs/kernel_notes.md: 1.19x at d128 by key_ranges.py at 8e27c64): the launcher
    alone (range tensor given: the kernels' cost) and flash_attention (its argument checks, one
    device sync, included), each measured twice, alternating, every kernel compiled before timing."""
    a = run.args
    start = time.monotonic()
    batch = 4
    for d in (128, 64):
        calls = range_calls(a, d, batch)
        with torch.no_grad():
            for fn in calls.values():
                fn()
            for repeat in (1, 2):
                for (path, setting), fn in calls.items():
                    base = dict(part_d=d, path=path, setting=setting, repeat=repeat, n=a.n_sweep, batch=batch)
                    if time.monotonic() - start > budget:
                        run.record("ranges", **base, status="skipped: budget")
                        continue
                    run.record("ranges", **base, ms=median_ms(fn, a.rep_ms), status="ok")
        del calls
        free_memory()


def precision_case(a, d: int) -> dict:
    """Inputs of one head dim: float64 and float32 copies (B=1, H=2), the float64 reference of
    every stage output, plain PyTorch float32's errors (TF32 off), and timing inputs (B=1, H)."""
    full = random_inputs(1, 2, 2, a.n_precision, d, torch.float64, seed=1)
    low = [t.float() for t in full]

    def naive(q, k, v):
        return attention_naive(q, k, v, causal=True, window=None, scale=d**-0.5)

    ref = all_orders(naive, *full)
    tf32_matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch_err = [rel(x, r) for x, r in zip(all_orders(naive, *low), ref)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_matmul
    timing = random_inputs(1, a.heads, a.heads, a.n_precision, d, torch.float32, seed=2)
    return {"low": low, "ref": ref, "torch_err": torch_err, "timing": timing}


def precision_runs(modes: list, settings: list, head_dims: list, low: str) -> list[tuple]:
    """(mode, setting, head dim) in the order the precision part measures them: modes outermost,
    then the settings in order, each across the head dims that have it; the low-precision mode
    (`low`, for scale) only with the default."""
    runs = []
    for mode in modes:
        for setting in (["default"] if mode == low else settings):
            runs += [(mode, setting, d) for d in head_dims if fp32_settings(d, setting) is not None]
    return runs


def part_precision(run: Run, budget: float) -> None:
    """Modes outermost, the candidate defaults first: IEEE (the slowest to compile) is the baseline
    of speed only; the error criterion is plain PyTorch float32's."""
    a = run.args
    start = time.monotonic()
    names = ("out", "dq", "dk", "dv", "grad_q", "grad_k", "grad_v", "grad_dout")
    cases = {d: precision_case(a, d) for d in a.precision_d}
    modes = [a.low if m == "low" else m for m in a.precision_modes]
    for mode, setting, d in precision_runs(modes, a.precision_settings, list(cases), a.low):
        case = cases[d]
        base = dict(part_d=d, mode=mode, n=a.n_precision, setting=setting,
                    override=json.dumps(fp32_settings(d, setting) if mode != a.low else {}))
        if time.monotonic() - start > budget:
            run.record("precision", **base, status="skipped: budget")
            continue
        with overrides(fp32_settings(d, setting) if mode != a.low else {}):
            try:
                inputs = [t.to(DTYPES[a.low]) for t in case["timing"]] if mode == a.low else case["timing"]
                attention = ours("causal", None if mode == a.low else mode)
                errors, first_s = {}, None
                if mode != a.low:
                    t0 = time.perf_counter()
                    got = all_orders(attention, *case["low"])
                    sync()
                    first_s = time.perf_counter() - t0
                    pairs = list(zip(names, got, case["ref"], case["torch_err"]))
                    errors = {f"err_{n}": rel(x, r) for n, x, r, _ in pairs}
                    errors.update({f"torch_err_{n}": e for n, _, _, e in pairs})
                    errors["worst_ratio_to_torch"] = max(rel(x, r) / max(e, 1e-30) for _, x, r, e in pairs)
                fwd_bwd_ms = median_ms(fwd_bwd_call(attention, *inputs[:4]), a.rep_ms)
                bob_ms = median_ms(bob_call(attention, *inputs), a.rep_ms)
                run.record("precision", **base, fwd_bwd_ms=fwd_bwd_ms, bob_ms=bob_ms, first_call_s=first_s,
                           **errors, status="ok")
            except Exception as exc:
                run.record("precision", **base, status=failure(exc))
    del cases
    free_memory()


def compiled_count() -> int | None:
    """Kernels compiled so far in this process (None under the interpreter, which compiles none)."""
    from kernels import _backward, _bob, _forward

    total = 0
    for name in KERNEL_FNS:
        fn = next(getattr(m, name) for m in (_forward, _backward, _bob) if hasattr(m, name))
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(cache[0]) for cache in caches.values())
    return total


def first_call_child(family: list, n: int) -> dict:
    """Run in a fresh process: first-call seconds of one family, then a call at n + 1 in the
    (B, N, H, D) layout and the kernels it compiled."""
    dtype, d, mask, h_kv, precision = family
    attention = ours(mask, precision)
    times = {}
    for label, size, layout in (("first", n, "bhnd"), ("second", n + 1, "bnhd")):
        q, k, v, dout, u_q, u_k, u_v = random_inputs(1, 4, h_kv, size, d, DTYPES[dtype], layout=layout)
        before = compiled_count()
        q, k, v, dout = (t.requires_grad_() for t in (q, k, v, dout))
        t0 = time.perf_counter()
        out = attention(q, k, v)
        sync()
        t1 = time.perf_counter()
        firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
        sync()
        t2 = time.perf_counter()
        torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v))
        sync()
        t3 = time.perf_counter()
        after = compiled_count()
        times.update({f"{label}_forward_s": t1 - t0, f"{label}_backward_s": t2 - t1,
                      f"{label}_bob_s": t3 - t2,
                      f"{label}_total_s": t3 - t0,
                      f"{label}_compiled": None if before is None else after - before})
    return {**times, "precompile": precompile.switched_on()}


def part_first_call(run: Run, budget: float) -> None:
    """One fresh process per family, --first-call-jobs of them side by side (compilation is
    single-threaded per process; the GPU machine has cores to spare); a child still running at
    the end of the budget is killed and recorded as such."""
    deadline = time.monotonic() + budget
    script = os.path.abspath(__file__)
    pending = first_call_runs(run.args)
    running = []
    while pending or running:
        while pending and len(running) < run.args.first_call_jobs and deadline - time.monotonic() > 5:
            family = pending.pop(0)
            env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="flashbob_cache_"))
            cmd = [sys.executable, script, "--child-first-call", json.dumps(family[:5]),
                   "--child-setting", family[5], "--n-first", str(run.args.n_first)]
            logs = tuple(os.path.join(env["TRITON_CACHE_DIR"], name) for name in ("stdout", "stderr"))
            with open(logs[0], "w") as out, open(logs[1], "w") as err:
                running.append((family, subprocess.Popen(cmd, env=env, stdout=out, stderr=err), logs))
        if not running:
            for family in pending:
                run.record("first_call", **family_fields(family), status="skipped: budget")
            return
        time.sleep(0.2)
        for item in list(running):
            family, proc, logs = item
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                status = {"status": "failed: still running at the end of the budget"}
            elif proc.returncode != 0:
                tail = read(logs[1]).strip().splitlines()[-1:] or [""]
                status = {"status": f"failed: rc {proc.returncode}: {tail[0][:200]}"}
            else:
                status = {**json.loads(read(logs[0]).strip().splitlines()[-1]), "status": "ok"}
            run.record("first_call", **family_fields(family), **status)
            running.remove(item)


def first_call_runs(args) -> list[list]:
    """The first-call part's families (--first-call-families, else the first --families), bf16 as
    args.low, each as [dtype, head dim, mask, kv heads, fp32_precision, setting]: float32 families
    once per --first-call-settings name their head dim has, the others with the default."""
    chosen = (FAMILIES[:args.families] if args.first_call_families is None
              else [FAMILIES[i] for i in args.first_call_families])
    runs = []
    for f in chosen:
        family = [args.low if f[0] == "bf16" else f[0], *f[1:]]
        names = args.first_call_settings if family[0] == "fp32" else ["default"]
        runs += [[*family, name] for name in names if fp32_settings(family[1], name) is not None]
    return runs


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def family_fields(family: list) -> dict:
    dtype, d, mask, h_kv, precision, setting = family
    return dict(dtype=dtype, part_d=d, mask=mask, gqa=f"4:{h_kv}", mode=precision or "default",
                setting=setting, override=json.dumps(fp32_settings(d, setting) if dtype == "fp32" else {}))


def listen(shared_rows: dict):
    """A tiling.launch_listener that keeps one row per distinct compiled launch."""

    def listener(kernel, cfg, estimate, compiled, itemsize, precision):
        metadata = getattr(compiled, "metadata", None)
        key = (kernel, json.dumps(cfg, sort_keys=True), itemsize, precision)
        if key not in shared_rows:
            shared_rows[key] = dict(kernel=kernel, settings=key[1], itemsize=itemsize, mode=precision,
                                    estimate=estimate, shared=getattr(metadata, "shared", None),
                                    regs=getattr(compiled, "n_regs", None),
                                    spills=getattr(compiled, "n_spills", None))

    return listener


def summary(rows: list[dict]) -> str:
    lines = ["part        | case                                   | result"]
    for r in rows:
        if r["part"] == "meta":
            if r.get("status", "ok") != "ok":
                lines.append(f"{'meta':<11} | part {r['finished']:<33} | {r['status']}")
            continue
        if r["part"] == "sweep":
            case = f"d{r['part_d']} {r['mask']} {r['setting']}"
            split = (f", rows {r['rows_ms']:.2f} + cols {r['cols_ms']:.2f} ms"
                     if r.get("rows_ms") is not None else "")
            result = (f"{r['ms']:.2f} ms, {r['ratio']:.2f}x flash{split}, "
                      f"diff {r['rel_diff_to_default']:.1e}, err/torch {r['err_ratio_to_torch']:.2f}, "
                      f"det {r['deterministic']}, {r['status']}" if r.get("ms") else r["status"])
        elif r["part"] == "ranges":
            case = f"d{r['part_d']} forward {r['path']} {r['setting']} #{r['repeat']}"
            result = f"{r['ms']:.3f} ms" if r.get("ms") else r["status"]
        elif r["part"] == "precision":
            setting = r.get("setting") or "default"
            case = f"d{r['part_d']} {r['mode']}" + (f" {setting}" if setting != "default" else "")
            worst = r.get("worst_ratio_to_torch")
            result = (f"bob {r['bob_ms']:.2f} ms, fwd+bwd {r['fwd_bwd_ms']:.2f} ms"
                      + (f", worst err / torch fp32 {worst:.2f}" if worst is not None else "")
                      if r.get("bob_ms") else r["status"])
        elif r["part"] == "first_call":
            setting = r.get("setting") or "default"
            case = f"{r['dtype']} d{r['part_d']} {r['mask']} {r['gqa']} {r['mode']}" + (
                f" {setting}" if setting != "default" else "")
            result = (f"first {r['first_total_s']:.1f} s, at N+1 {r['second_total_s']:.2f} s, "
                      f"compiled {r['second_compiled']}") if r["status"] == "ok" else r["status"]
        elif r.get("shared") is not None:
            cfg = json.loads(r["settings"])
            case = (f"{r['kernel']} {r['itemsize']}B {r['mode']} {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x"
                    f"{cfg['BLOCK_D']} w{cfg['num_warps']} s{cfg['num_stages']}")
            result = f"shared {r['shared'] / 1024:.0f} KiB, estimate {r['estimate'] / 1024:.0f} KiB"
            if r.get("regs") is not None:
                result += f", {r['regs']} registers, {r['spills']} spills"
        else:
            continue
        lines.append(f"{r['part']:<11} | {case:<38} | {result}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="portable_out", help="directory for results.csv and results.jsonl")
    p.add_argument("--parts", default="sweep,precision,first_call",
                   help="comma-separated subset of sweep, ranges, precision, first_call, in order")
    p.add_argument("--budget-sweep", type=float, default=170.0, help="seconds")
    p.add_argument("--budget-ranges", type=float, default=30.0, help="seconds")
    p.add_argument("--budget-precision", type=float, default=110.0, help="seconds")
    p.add_argument("--budget-first-call", type=float, default=75.0, help="seconds")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--n-sweep", type=int, default=16384)
    p.add_argument("--n-precision", type=int, default=4096)
    p.add_argument("--n-first", type=int, default=1000)
    p.add_argument("--n-check", type=int, default=1028,
                   help="length of the sweep's float64 error check (ragged against the tiles)")
    p.add_argument("--precision-d", default="64,128", help="comma-separated head dims of the precision part")
    p.add_argument("--precision-modes", default="tf32x3,tf32,ieee,low",
                   help="comma-separated fp32_precision modes of the precision part, in order (low: bf16)")
    p.add_argument("--precision-settings", default="default",
                   help="comma-separated FP32_SETTINGS names for the precision part, in order")
    p.add_argument("--first-call-settings", default="default",
                   help="comma-separated FP32_SETTINGS names each float32 first-call family runs under")
    p.add_argument("--first-call-families", default=None,
                   help="comma-separated indices into FAMILIES (instead of the first --families)")
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench's timed milliseconds per measurement")
    p.add_argument("--settings", type=int, default=99, help="first SETTINGS sweep settings per head dim")
    p.add_argument("--families", type=int, default=len(FAMILIES), help="first FAMILIES first-call families")
    p.add_argument("--first-call-jobs", type=int, default=4, help="first-call processes side by side")
    p.add_argument("--smoke", action="store_true", help="toy sizes (a test of this script; CPU or GPU)")
    p.add_argument("--child-first-call", help=argparse.SUPPRESS)
    p.add_argument("--child-setting", default="default", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    args.precision_d = [int(x) for x in args.precision_d.split(",") if x]
    args.precision_modes = [x for x in args.precision_modes.split(",") if x]
    args.precision_settings = [x for x in args.precision_settings.split(",") if x]
    args.first_call_settings = [x for x in args.first_call_settings.split(",") if x]
    args.first_call_families = (None if args.first_call_families is None
                                else [int(x) for x in args.first_call_families.split(",") if x])
    known = {name for entries in FP32_SETTINGS.values() for name, _ in entries}
    for option in ("precision_settings", "first_call_settings"):
        unknown_settings = sorted(set(getattr(args, option)) - known)
        if unknown_settings:
            p.error(f"--{option.replace('_', '-')}: unknown {unknown_settings}; choose from {sorted(known)}")
    bad_modes = sorted(set(args.precision_modes) - {"tf32x3", "tf32", "ieee", "low"})
    if bad_modes:
        p.error(f"--precision-modes: unknown {bad_modes}; choose from tf32x3, tf32, ieee, low")
    families = args.first_call_families
    if families is not None and not all(0 <= i < len(FAMILIES) for i in families):
        p.error(f"--first-call-families: indices into FAMILIES must be in [0, {len(FAMILIES)}), "
                f"got {args.first_call_families}")
    unknown = set(args.parts) - {"sweep", "ranges", "precision", "first_call"}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from sweep, ranges, precision, first_call")
    args.low = "bf16"
    if args.smoke:  # float16 for bfloat16: the interpreter's bfloat16 is wrong
        args.heads, args.n_sweep, args.n_precision, args.n_first, args.rep_ms = 2, 20, 17, 17, 4
        args.n_check = 20
        args.low = "fp16"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child_first_call:
        family = json.loads(args.child_first_call)
        with overrides(fp32_settings(family[1], args.child_setting) if family[0] == "fp32" else {}):
            print(json.dumps(first_call_child(family, args.n_first)))
        return
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("benchmarks/portable.py needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    run = Run(args)
    run.record("meta", gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               torch=torch.__version__, commit=commit(), command=" ".join(sys.argv),
               limits=str(tiling.device_limits(torch.device(device()))))
    shared_rows: dict = {}
    tiling.launch_listener = listen(shared_rows)
    parts = {"sweep": (part_sweep, args.budget_sweep), "ranges": (part_ranges, args.budget_ranges),
             "precision": (part_precision, args.budget_precision),
             "first_call": (part_first_call, args.budget_first_call)}
    for name in args.parts:
        fn, budget = parts[name]
        t0 = time.monotonic()
        try:
            fn(run, budget)
            status = "ok"
        except Exception as exc:  # a part's setup failed (e.g. out of memory): the next part still runs
            status = failure(exc)
            free_memory()
        run.record("meta", finished=name, seconds=time.monotonic() - t0, status=status)
        run.save()
    for row in shared_rows.values():
        run.record("shared", **row)
    run.save()
    print(summary(run.rows))


if __name__ == "__main__":
    main()
