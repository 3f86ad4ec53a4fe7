"""Same-run A/B: this tree's kernels against another commit's (or several sides), on one GPU.

    python -m flashbob.bench ab --base main                      # this tree (B) against commit main (A)
    python -m flashbob.bench ab --base main_copy/ --side fix=. --side old=HEAD~5 --d 64 --mask causal

Sides. --base is side A; each --side NAME=WHERE adds one (without any, the one other side is this
tree, "this"). WHERE is a directory holding flashbob/ (a checkout, a `git worktree`, or a copy made
by `git archive COMMIT flashbob | tar -x -C DIR`; the folder is kernels/ in commits before the rename)
or a commit, which is extracted that way into a temporary directory (needs git here). Each side's
package is imported under a module name of its own (flashbob_ab_<i>) without its __init__.py, which
would register torch.library ops under names another side already holds, and runs through its
launchers in triton_ops.py: forward, backward and bob take the same arguments in every version since
the BoB kernels exist.

Cases: each (head dim, mask) of --d x --mask at --n tokens, --batch, --heads, --dtype. Modes: bob (the
BoB launcher alone, on out, lse and dq made once per side by its own forward and backward) and step
(forward, first backward and BoB launchers in a row: the kernel work of one second-order step,
autograd's bookkeeping left out). Yardsticks: torch SDPA's flash backend forward + backward through
autograd, and its cuDNN backend likewise (FlashAttention-3 class on Hopper; "-" where cuDNN refuses the
shape), timed in the same rounds.

Timing. A warm-up first compiles every side's kernels: --warm-jobs processes side by side, each
running one (side, case) at a short length, fill Triton's on-disk cache, which the timing process
then reads (a kernel compiles the same for any length divisible by 16); then each timed function is
called once. Then, per (case, mode), --rounds rounds: in each, every side and the yardstick run
--iters calls back to back between two CUDA events (the host's launch work overlaps the GPU's, as in
a training loop), whose mean per call is the round's time, in an order that rotates from round to
round (A B Y, B Y A, Y A B, ...). A side's ratio to A is taken round by round; the table
gives its median and [min, max] over the rounds (the spread: a ratio whose interval holds 1.00 is
no difference), the median time (with --kernel-split also the rows and columns kernels' GPU ms from
the profiler and the GPU's idle ms between the BoB's kernels), the ratios to the yardsticks' medians,
"host ms", the host's time per call to issue --iters calls back to back (the floor of a call's time
where the GPU's work is shorter: short sequences), and "diff", the largest relative difference of
the side's four BoB outputs to A's on the same inputs (bitwise-equal arithmetic: 0). Off CUDA
(tests, the Triton interpreter) the host clock times the calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import types

import torch

from flashbob.bench import (
    DTYPES,
    IDLE_KEY,
    Results,
    block_ms,
    device,
    fwd_bwd_call,
    host_ms,
    int_list,
    kernel_times,
    meta,
    parse_mask,
    random_inputs,
    rel,
    str_list,
    sync,
    yardstick,
)

MODES = ("bob", "step")
SPLIT_KERNELS = {"rows_ms": "attention_bob_rows", "cols_ms": "attention_bob_cols",
                 "row_dot_ms": "row_dot_kernel", "idle_ms": IDLE_KEY}
"""With --kernel-split, the BoB mode's GPU ms per call in each kernel (the profiler's names), and the
GPU's idle ms per call between them (IDLE_KEY)."""
WARM_N = 256
"""Length of the warm-up calls: a multiple of 16, so kernels that specialize on lengths (older
versions) compile what the timed lengths run."""
_loaded: dict[str, types.ModuleType] = {}


@dataclasses.dataclass
class Side:
    name: str
    where: str
    """What the command line named (directory or commit)."""
    root: str
    """This side's package folder (flashbob/, or kernels/ of a commit before the rename)."""
    module: str
    """The name its flashbob/ is imported under."""

    @property
    def ops(self) -> types.ModuleType:
        """This side's flashbob/triton_ops.py."""
        return import_side(self.root, self.module)


PACKAGE_NAMES = ("flashbob", "kernels")
"""The package's folder name: `flashbob`, and `kernels` in commits before the rename."""


def import_side(package_dir: str, module: str) -> types.ModuleType:
    """package_dir/triton_ops.py, imported as `module`.triton_ops; `module` is a package object made
    here (its __init__.py is not run), so sides do not collide."""
    if module not in _loaded:
        if not os.path.isfile(os.path.join(package_dir, "triton_ops.py")):
            raise ValueError(f"{package_dir!r} holds no triton_ops.py")
        package = types.ModuleType(module)
        package.__path__ = [package_dir]
        package.__file__ = os.path.join(package_dir, "__init__.py")
        sys.modules[module] = package
        _loaded[module] = importlib.import_module(f"{module}.triton_ops")
    return _loaded[module]


def package_in(root: str) -> str | None:
    """The FlashBoB package folder under root (flashbob/, or kernels/ of an older tree), or None."""
    for name in PACKAGE_NAMES:
        if os.path.isfile(os.path.join(root, name, "triton_ops.py")):
            return os.path.join(os.path.abspath(root), name)
    return None


def extract(commit: str, repo: str = ".") -> str:
    """The package folder of `commit` (flashbob/, or kernels/ before the rename), extracted by
    `git archive` into a temporary directory."""
    target = tempfile.mkdtemp(prefix=f"flashbob_ab_{re.sub(r'[^0-9A-Za-z]', '_', commit)}_")
    errors = []
    for name in PACKAGE_NAMES:
        try:
            archive = subprocess.run(["git", "-C", repo, "archive", commit, name], capture_output=True,
                                     check=True).stdout
        except (OSError, subprocess.CalledProcessError) as exc:
            errors.append(f"{name}/: {getattr(exc, 'stderr', b'').decode(errors='replace').strip() or exc}")
            continue
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
        return os.path.join(target, name)
    raise ValueError(f"{commit!r} is neither a directory holding flashbob/ (or kernels/) nor a commit git "
                     f"can archive here ({'; '.join(errors)})")


def this_tree() -> str:
    """The directory holding the flashbob/ package this module belongs to."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def resolve(where: str) -> str:
    """The package folder that WHERE names: a directory holding flashbob/ (or kernels/), the package
    folder itself, or a commit (extracted)."""
    found = package_in(where)
    if found:
        return found
    if os.path.isfile(os.path.join(where, "triton_ops.py")):
        return os.path.abspath(where)
    return extract(where)


def make_sides(base: str, extra: list[str]) -> list[Side]:
    """Side A from --base, then the --side NAME=WHERE entries (this tree when there are none)."""
    named = [("A", base)]
    for spec in extra or [f"this={this_tree()}"]:
        name, sep, where = spec.partition("=")
        if not sep or not name or not where:
            raise ValueError(f"--side takes NAME=WHERE, got {spec!r}")
        named.append((name, where))
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"side names must differ, got {names}")
    return [Side(name, where, resolve(where), f"flashbob_ab_{i}") for i, (name, where) in enumerate(named)]


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    d: int
    mask: str
    dtype: str
    batch: int
    heads: int

    @property
    def label(self) -> str:
        return f"{self.mask} d{self.d} N{self.n} {self.dtype}"


def launch_options(case: Case) -> dict:
    causal, window = parse_mask(case.mask)
    return dict(causal=causal, window=window, scale=case.d**-0.5)


def side_calls(ops, case: Case, inputs: list[torch.Tensor]) -> dict:
    """{"bob": the BoB launcher on out, lse, dq made once, "step": forward + backward + BoB,
    "outputs": the BoB's four outputs}, through one side's launchers."""
    q, k, v, dout, u_q, u_k, u_v = inputs
    opts = launch_options(case)
    out, lse = ops.forward(q, k, v, **opts)
    dq, _, _ = ops.backward(q, k, v, out, lse, dout, **opts)

    def bob():
        return ops.bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)

    def step():
        out_, lse_ = ops.forward(q, k, v, **opts)
        dq_, _, _ = ops.backward(q, k, v, out_, lse_, dout, **opts)
        return ops.bob(q, k, v, out_, lse_, dout, dq_, u_q, u_k, u_v, **opts)

    return {"bob": bob, "step": step, "outputs": bob()}


def warm(sides: list[Side], cases: list[Case], jobs: int) -> list[str]:
    """Compile every (side, case) in up to `jobs` processes side by side (Triton's on-disk cache);
    returns the failures' messages (the timing process then compiles those itself)."""
    if jobs <= 0:
        return []
    tasks = [{"root": s.root, "module": s.module, "case": dataclasses.asdict(c)}
             for s in sides for c in cases]
    running, failures = [], []
    while tasks or running:
        while tasks and len(running) < jobs:
            task = tasks.pop(0)
            cmd = [sys.executable, "-m", "flashbob.bench", "ab", "--warm-child", json.dumps(task)]
            running.append((task, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                   text=True)))
        task, proc = running.pop(0)
        _, err = proc.communicate()
        if proc.returncode:
            failures.append(f"warm-up {task['module']} {task['case']}: {err.strip().splitlines()[-1:]}")
    return failures


def warm_child(task: dict) -> None:
    """One warm-up process: the side's forward, backward and BoB once at WARM_N tokens."""
    case = Case(**{**task["case"], "n": WARM_N})
    inputs = random_inputs(case.batch, case.heads, case.heads, case.n, case.d, DTYPES[case.dtype])
    side_calls(import_side(task["root"], task["module"]), case, inputs)
    sync()


def rotate(items: list, r: int) -> list:
    r %= len(items)
    return items[r:] + items[:r]


def time_rounds(fns: dict, rounds: int, iters: int) -> dict[str, list[float]]:
    """{name: per round, the mean ms of its iters calls} with the order of fns rotating from round
    to round."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in rotate(list(fns), r):
            times[name].append(block_ms(fns[name], iters))
    return times


def spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run_case(results: Results, sides: list[Side], case: Case, modes: list[str], rounds: int,
             iters: int, kernel_split: bool = False) -> None:
    inputs = random_inputs(case.batch, case.heads, case.heads, case.n, case.d, DTYPES[case.dtype])
    calls = {s.name: side_calls(s.ops, case, inputs) for s in sides}
    diffs = {name: max(rel(x, y) for x, y in zip(c["outputs"], calls["A"]["outputs"]))
             for name, c in calls.items()}
    for c in calls.values():
        del c["outputs"]
    causal, _ = parse_mask(case.mask)
    yards = {"yardstick": fwd_bwd_call(yardstick(causal), *inputs[:4])}
    yards["yardstick"]()
    cudnn = fwd_bwd_call(yardstick(causal, "cudnn"), *inputs[:4])
    try:
        cudnn()
        yards["cudnn"] = cudnn
    except RuntimeError as err:  # the cuDNN backend refuses some shapes and GPUs: no second yardstick then
        print(f"{case.mask} d{case.d}: no cuDNN yardstick ({str(err).splitlines()[0]})", file=sys.stderr)
    for mode in modes:
        fns = {name: c[mode] for name, c in calls.items()}
        for fn in fns.values():
            fn()
        times = time_rounds({**fns, **yards}, rounds, iters)
        yard_ms = statistics.median(times["yardstick"])
        cudnn_ms = statistics.median(times["cudnn"]) if "cudnn" in times else None
        host = {name: host_ms(fn, iters) for name, fn in fns.items()}
        split = {}
        if kernel_split and mode == "bob" and torch.cuda.is_available():
            kernel_names = [k for k in SPLIT_KERNELS.values() if k != IDLE_KEY]
            for name in fns:
                own = kernel_times(fns[name], kernel_names)
                split[name] = {key: own[k] for key, k in SPLIT_KERNELS.items()}
        for s in sides:
            ms, ms_min, ms_max = spread(times[s.name])
            ratios = [t / a for t, a in zip(times[s.name], times["A"])]
            ratio, ratio_min, ratio_max = spread(ratios)
            results.record(**dataclasses.asdict(case), mode=mode, side=s.name, where=s.where, ms=ms,
                           ms_min=ms_min, ms_max=ms_max, ratio=ratio, ratio_min=ratio_min,
                           ratio_max=ratio_max, yardstick_ms=yard_ms, vs_yardstick=ms / yard_ms,
                           cudnn_ms=cudnn_ms, vs_cudnn=None if cudnn_ms is None else ms / cudnn_ms,
                           diff=diffs[s.name], host_ms=host[s.name], rounds=rounds, iters=iters,
                           **split.get(s.name, {}))
    del calls, inputs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(rows: list[dict], info: dict) -> str:
    lines = [f"{info.get('device')}; torch {info.get('torch')}, triton {info.get('triton')}; run from "
             f"commit {info.get('commit')}; B={info['batch']}, H={info['heads']}; "
             f"{info['rounds']} rounds of {info['iters']} calls; sides: "
             + ", ".join(f"{s['name']} = {s['where']}" for s in info["sides"]),
             "", "| case | mode | side | ms (median [min, max]) | ratio to A (median [min, max]) | "
             "/ yardstick | yardstick ms | / cuDNN | cuDNN ms | host ms | diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        split = (f" (rows {r['rows_ms']:.2f}, cols {r['cols_ms']:.2f}, idle {r['idle_ms']:.2f})"
                 if r.get("rows_ms") is not None else "")
        cudnn = "- | -" if r.get("cudnn_ms") is None else f"{r['vs_cudnn']:.2f} | {r['cudnn_ms']:.3f}"
        lines.append(
            f"| {r['mask']} d{r['d']} N{r['n']} {r['dtype']} | {r['mode']} | {r['side']} | "
            f"{r['ms']:.3f} [{r['ms_min']:.3f}, {r['ms_max']:.3f}]{split} | "
            f"{r['ratio']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}] | {r['vs_yardstick']:.2f} | "
            f"{r['yardstick_ms']:.3f} | {cudnn} | {r['host_ms']:.3f} | {r['diff']:.1e} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashbob.bench ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="side A: a directory holding flashbob/, or a commit")
    p.add_argument("--side", action="append", default=[],
                   help="NAME=WHERE, repeatable (default: this=<this tree>)")
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", default="64,128", help="comma-separated head dims")
    p.add_argument("--mask", default="causal,full", help="comma-separated: full, causal, windowW")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--modes", default="bob,step", help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=10, help="timed calls per side per round")
    p.add_argument("--warm-jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="warm-up processes side by side (0: compile in the timing process)")
    p.add_argument("--kernel-split", action="store_true",
                   help="also each side's GPU ms per BoB kernel (the profiler, after the rounds)")
    p.add_argument("--out", default=None, help="directory for results.csv, results.json, table.md")
    p.add_argument("--warm-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warm_child is None and not args.base:
        p.error("--base is required")
    args.modes = str_list(args.modes)
    if set(args.modes) - set(MODES) or not args.modes:
        p.error(f"--modes: choose from {', '.join(MODES)}, got {args.modes}")
    for mask in str_list(args.mask):
        try:
            parse_mask(mask)
        except ValueError as exc:
            p.error(f"--mask: {exc}")
    if args.rounds < 1 or args.iters < 1:
        p.error("--rounds and --iters must be at least 1")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.warm_child:
        warm_child(json.loads(args.warm_child))
        return []
    sides = make_sides(args.base, args.side)
    cases = [Case(args.n, d, mask, args.dtype, args.batch, args.heads)
             for d in int_list(args.d) for mask in str_list(args.mask)]
    info = meta("flashbob.bench", ["ab", *(sys.argv[1:] if argv is None else argv)], batch=args.batch,
                heads=args.heads, rounds=args.rounds, iters=args.iters,
                sides=[{"name": s.name, "where": s.where, "root": s.root} for s in sides])
    results = Results(args.out, info)
    for failure in warm(sides, cases, args.warm_jobs if device() == "cuda" else 0):
        print(failure, flush=True)
    for case in cases:
        run_case(results, sides, case, args.modes, args.rounds, args.iters, args.kernel_split)
    results.finish(table(results.rows, info))
    return results.rows


if __name__ == "__main__":
    main()
