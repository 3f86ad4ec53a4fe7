"""Meta-training under Lightning's DDP strategy with 2 CPU processes (gloo on localhost), through the
command line: P processes with meta_batch_size b reach the parameters of one process with P * b
(second-order meta-gradients, float64, plain SGD so that a mis-scaled gradient shows), gradients are
all-reduced once per outer step, metrics are averaged over the processes, and a resumed 2-process run
reaches the uninterrupted state; for maml_sinusoid, maml_longctx and ttt_e2e at toy size. Each run is
a subprocess with one thread per process (5-20 s each on 2 cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_configs import TINY_KV_MODEL, TINY_KV_TASK, TINY_TEXT, write_tiny_corpus

# Processes started per test, tens of seconds each on two cores; one such test at a time (pytest -n 2
# with --dist loadgroup, pyproject.toml) so that their processes do not compete with each other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("processes")]

REPO = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).with_name("count_allreduce.py")
TIMEOUT_S = 120

COMMON = [
    "trainer.max_steps=2",
    "trainer.steps_per_epoch=1",
    "trainer.val_tasks=4",
    "trainer.test_tasks=4",
    "trainer.eval_batch_size=1",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "trainer.accelerator=cpu",
    "trainer.precision=64-true",
    "run.tensorboard=false",
    "optim.name=sgd",
    "optim.beta1=0",
    "optim.lr=0.5",
    "optim.grad_clip=null",
    "optim.scheduler=constant",
    "optim.warmup_steps=0",
]
DDP = ["trainer.strategy=ddp", "trainer.devices=2"]
TINY_RECIPES = {
    "maml_sinusoid": ["model.hidden_sizes=[8,8]", "inner.steps=2", "inner.eval_steps=2"],
    "maml_longctx": [*TINY_KV_MODEL, *TINY_KV_TASK],
    "ttt_e2e": ["data.corpus=corpus", *TINY_TEXT],
}


def launch(command: list[str], cwd: Path, returncode: int = 0) -> str:
    """Run `command` in `cwd` on localhost with one thread per process; fail with its output unless it
    exits with `returncode`. Returns its stderr."""
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "TTT_RUN_DIR")}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(REPO))
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == returncode, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stderr


def train(
    cwd: Path, recipe: str, name: str, *overrides: str, counts: Path | None = None, entry: list | None = None
) -> Path:
    """`python -m ttt.train` of the tiny `recipe` into cwd/runs/name, or with `counts` the same through
    count_allreduce.py, which writes the gradient all-reduces of each outer step there, or through the
    script and arguments `entry`; returns the run directory."""
    if recipe == "ttt_e2e":
        write_tiny_corpus(cwd / "corpus")
    args = [f"recipe={recipe}", *TINY_RECIPES[recipe], *COMMON, f"run.name={name}", *overrides]
    if entry is None:
        entry = ["-m", "ttt.train"] if counts is None else [str(PROBE), str(counts)]
    launch([sys.executable, *entry, *args], cwd)
    return cwd / "runs" / name


def parameters(run: Path) -> dict[str, torch.Tensor]:
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 2
    return checkpoint["state_dict"]


def train_losses(run: Path, key: str) -> list[float]:
    """Training loss `key` of every outer step, as rank 0 logged it."""
    lines = (run / "logs" / "version_0" / "metrics.csv").read_text().splitlines()
    column = lines[0].split(",").index(key)
    return [float(row.split(",")[column]) for row in lines[1:] if row.split(",")[column]]


def assert_same_state(run: Path, reference: Path, tolerance: float = 1e-12) -> None:
    got, want = parameters(run), parameters(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == torch.float64
        torch.testing.assert_close(
            got[name],
            want[name],
            rtol=tolerance,
            atol=tolerance,
            msg=lambda text, name=name: f"{name}: {text}",
        )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """recipe -> the run directory of one process with meta_batch_size 4 (run once per module)."""
    cwd, runs = tmp_path_factory.mktemp("one_process"), {}

    def run(recipe: str) -> Path:
        if recipe not in runs:
            runs[recipe] = train(cwd, recipe, recipe, "trainer.meta_batch_size=4")
        return runs[recipe]

    return run


@pytest.mark.parametrize("recipe", ["maml_sinusoid", "maml_longctx", "ttt_e2e"])
def test_two_processes_reach_the_parameters_of_one_process_over_the_global_batch(
    recipe, one_process, tmp_path
):
    one = one_process(recipe)
    counts = tmp_path / "allreduce_counts.json"
    two = train(tmp_path, recipe, "two", "trainer.meta_batch_size=2", *DDP, counts=counts)
    assert_same_state(two, one)
    # Each tiny model fits one DDP bucket: one all-reduce per outer step, none per task (2 per process)
    # or inner step.
    assert json.loads(counts.read_text()) == [1, 1]
    # Metrics: the processes' means are averaged into the global batch's mean (up to the float32
    # rounding of the language models' cross-entropy, which the two runs sum in different orders).
    loss = "train/loss" if recipe == "ttt_e2e" else "train/outer_loss"
    assert train_losses(two, loss) == pytest.approx(train_losses(one, loss), rel=1e-6)
    summaries = [json.loads((run / "summary.json").read_text()) for run in (one, two)]
    for key in ("query_loss_unadapted", "query_loss_adapted"):
        assert summaries[1][key] == pytest.approx(summaries[0][key], rel=1e-6)
    if recipe == "ttt_e2e":  # each process's test windows, gathered in the single process's order
        windows = [(run / "late_loss_by_window.csv").read_text().splitlines() for run in (one, two)]
        assert [line.split(",")[0] for line in windows[1]] == [line.split(",")[0] for line in windows[0]]
        assert len(windows[0]) == 5
        for got, want in zip(windows[1][1:], windows[0][1:]):
            assert [float(v) for v in got.split(",")[1:]] == pytest.approx(
                [float(v) for v in want.split(",")[1:]]
            )
    # One run directory, written by rank 0 only.
    assert [path.name for path in (tmp_path / "runs").iterdir()] == ["two"]
    assert [path.name for path in (two / "logs").iterdir()] == ["version_0"]


def test_resumed_two_process_run_reaches_the_uninterrupted_state(one_process, tmp_path):
    reference = one_process("maml_sinusoid")
    first = train(tmp_path, "maml_sinusoid", "two", "trainer.meta_batch_size=2", "trainer.max_steps=1", *DDP)
    launch([sys.executable, "-m", "ttt.train", f"resume={first}", "trainer.max_steps=2"], tmp_path)
    assert_same_state(first, reference)
    assert sorted(path.name for path in (first / "logs").iterdir()) == ["version_0", "version_1"]


def test_parameters_without_outer_gradient_name_the_key_that_allows_them(tmp_path):
    # With no inner step, the learnable inner learning rate gets no gradient.
    args = ["recipe=maml_sinusoid", *TINY_RECIPES["maml_sinusoid"], *COMMON, *DDP, "run.name=unused"]
    args += ["trainer.meta_batch_size=2", "inner.steps=0", "inner.learnable_lr=tensor"]
    stderr = launch([sys.executable, "-m", "ttt.train", *args], tmp_path, returncode=2)
    assert "error: some trainable parameters got no outer gradient" in stderr
    assert "trainer.find_unused_parameters=true" in stderr


def test_two_processes_follow_the_short_then_long_context_schedule_of_one(tmp_path):
    """data.short_steps: step 1 reads 2 rows of 32 tokens per task (2 chunks each), step 2 one row of
    64; the DDP shares of each step are the single process's rows, so both runs reach the same
    parameters."""
    schedule = ["data.seq_len=64", "data.short_seq_len=32", "data.short_steps=1"]
    one = train(tmp_path / "one", "ttt_e2e", "one", "trainer.meta_batch_size=4", *schedule)
    two = train(tmp_path / "two", "ttt_e2e", "two", "trainer.meta_batch_size=2", *schedule, *DDP)
    assert_same_state(two, one)
