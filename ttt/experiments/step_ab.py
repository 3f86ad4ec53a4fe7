"""Same-session A/B of the outer step: `ttt.experiments.scale`'s measurement of this tree and of a base
(a commit or a directory), alternated round by round, each in a process of its own.

    python -m ttt.experiments.scale recipe=ttt_e2e_125m --modes second --steps 3 --base main --rounds 2
        [--budget 540]

Each round runs every mode once per tree, in an order that alternates (this, base; base, this; ...),
so that a drift of the machine (clocks, temperature, a neighbour) does not favour one side. A tree's
process runs its own code: `python -m ttt.experiments.scale` in the tree's directory with that directory
first on PYTHONPATH (the packages it does not hold come from this environment). Rows are the scale
rows with "tree" ("this" or "base"), "code" (the commit, "+dirty" for a changed checkout, or the
directory) and "round" added. The summary gives, per mode, each round's s_per_step of both trees, and
this / base round by round with its median and [min, max] over the rounds (the spread: an interval
that holds 1.00 is no difference measured); a round that one tree did not finish gives no ratio.

Overrides for the base side alone (`--base-override KEY=VALUE`) make an A/B of options: with `--base .`
this tree against itself with other settings, its code "." plus those overrides.

With a budget (seconds of wall time, for a machine that stops a command at a limit), no process starts
once the time used plus the longest process so far would pass it: the A/B stops there, says so, and
prints the summary of what ran.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, replace

from flashbob.bench.ab import spread
from flashbob.environment import commit

from .json_lines import emit

PROJECT_FOLDERS = ("ttt", "flashbob", "recipes", "configs")
"""What a tree needs to run the step, the folders a commit is extracted with (a commit from before the
kernels/ -> flashbob/ rename has no flashbob/: `git archive` refuses it; pass such a tree as a
directory)."""


@dataclass(frozen=True)
class Tree:
    """One side of the A/B: its label, the directory its code runs from, what that code is, and whether
    the directory is a temporary extraction (removed after the A/B)."""

    label: str
    root: str
    code: str
    extracted: bool = False


def this_tree() -> Tree:
    """This checkout: the directory holding the ttt package, its commit where git can name it
    ($FLASHBOB_COMMIT when set, as for every benchmark record: a copy whose .git is stale)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return Tree("this", root, os.environ.get("FLASHBOB_COMMIT") or code_of(root))


def code_of(root: str) -> str:
    """root's commit (`flashbob.environment.commit`: "+dirty" for uncommitted changes), or the directory
    where git cannot name one (a copy without .git of its own)."""
    code = commit(root)
    return os.path.abspath(root) if code == "unknown" else code


def git(root: str, *args: str) -> str:
    """git's standard output for `git -C root args...` (CalledProcessError when it fails)."""
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True).stdout


def base_tree(where: str) -> Tree:
    """The base side: a directory holding ttt/experiments/scale.py, or a commit of this checkout,
    extracted with `git archive` into a temporary directory. ValueError naming --base otherwise."""
    if os.path.isfile(os.path.join(where, "ttt", "experiments", "scale.py")):
        return Tree("base", os.path.abspath(where), code_of(where))
    here = this_tree().root
    try:
        sha = git(here, "rev-parse", "--short=12", f"{where}^{{commit}}").strip()
        archive = subprocess.run(
            ["git", "-C", here, "archive", sha, *PROJECT_FOLDERS], capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise ValueError(
            f"--base must be a directory holding ttt/experiments/scale.py or a commit git can archive "
            f"here; got {where!r} ({getattr(err, 'stderr', b'') or err})"
        ) from err
    target = tempfile.mkdtemp(prefix=f"step_ab_{sha}_")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return Tree("base", target, sha, extracted=True)


def measure_tree(tree: Tree, overrides: list[str], modes: list[str], steps: int) -> list[dict]:
    """The scale rows of `modes` (one per mode) measured by the tree's own code in a new process.
    RuntimeError with the process's last output lines when it fails."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "rows.jsonl")
        command = [sys.executable, "-m", "ttt.experiments.scale", *overrides]
        command += ["--steps", str(steps), "--modes", ",".join(modes), "--out", out]
        path = os.pathsep.join(filter(None, [tree.root, os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        done = subprocess.run(command, cwd=tree.root, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeError(f"the {tree.label} tree ({tree.code}) exited with {done.returncode}:\n{tail}")
        with open(out) as handle:
            return [json.loads(line) for line in handle if line.strip()]


def run(
    overrides: list[str], modes: list[str], steps: int, base: str, rounds: int, out: str | None,
    budget_s: float | None = None, base_overrides: tuple[str, ...] = (),
) -> list[dict]:
    """The A/B (module docstring): rounds x trees x modes rows, emitted as they come (printed, and
    appended to out), then the summary printed; with budget_s, fewer rounds where the next process
    might not finish within it; base_overrides go to the base side only (after overrides: with base
    ".", an A/B of options in one tree). Returns the rows."""
    trees = [this_tree(), base_tree(base)]
    if base_overrides:
        trees[1] = replace(trees[1], code=" ".join([trees[1].code, *base_overrides]))
    sides = {"this": overrides, "base": [*overrides, *base_overrides]}
    rows, start, longest = [], time.monotonic(), 0.0
    try:
        for number, tree in ((n, t) for n in range(rounds) for t in (trees if n % 2 == 0 else trees[::-1])):
            used = time.monotonic() - start
            if budget_s is not None and used + longest > budget_s:
                print(
                    f"stopped before round {number + 1}'s {tree.label} tree: {used:.0f} s of the "
                    f"{budget_s:.0f} s budget used, and the longest process so far took {longest:.0f} s"
                )
                break
            began = time.monotonic()
            for row in measure_tree(tree, sides[tree.label], modes, steps):
                row = {**row, "tree": tree.label, "code": tree.code, "round": number}
                emit(row, out)
                rows.append(row)
            longest = max(longest, time.monotonic() - began)
    finally:
        if trees[1].extracted:
            shutil.rmtree(trees[1].root, ignore_errors=True)
    print(summary(rows, trees))
    return rows


def summary(rows: list[dict], trees: list[Tree]) -> str:
    """Markdown table: per mode, each tree's s_per_step by round and this / base by round with its
    median [min, max]; a mode either tree did not run ("oom" or another status) shows its status."""
    this, base = trees
    lines = [
        f"this = {this.code}, base = {base.code}",
        "",
        "| mode | this s/step by round | base s/step by round | this / base (median [min, max]) |",
        "|---|---|---|---|",
    ]
    for mode in dict.fromkeys(row["mode"] for row in rows):
        times = {  # label -> {round: s_per_step, None where the mode did not run ("oom" or another status)}
            label: {r["round"]: r.get("s_per_step") for r in rows if (r["mode"], r["tree"]) == (mode, label)}
            for label in ("this", "base")
        }
        cells = [", ".join("-" if t is None else f"{t:.3f}" for t in by.values()) for by in times.values()]
        paired = [(t, times["base"][r]) for r, t in times["this"].items() if r in times["base"]]
        if any(t is None for pair in paired for t in pair):
            ratio = "not every round ran: " + ", ".join(
                sorted({row["status"] for row in rows if row["mode"] == mode and row["status"] != "ok"})
            )
        elif not paired:
            ratio = "no round ran both trees"
        else:
            middle, low, high = spread([a / b for a, b in paired])
            ratio = f"{middle:.3f} [{low:.3f}, {high:.3f}]"
        lines.append(f"| {mode} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)
