"""`python -m ttt.evaluate`: a trained run's loss at every position of its test split, at another length,
with and without its inner steps (at the run's inner learning rates), as CSV and plots, runs overlaid;
overrides of the model and bad data refused with exit status 2."""

import csv
import re
import shutil

import numpy as np
import pytest

from recipes import load_builder
from ttt.evaluate import main
from ttt.meta.loading import load

SEQ_LEN = 96
OVERRIDES = [f"data.seq_len={SEQ_LEN}", "eval.passkey_lengths=[]", "trainer.test_tasks=4",
             "trainer.eval_batch_size=2"]  # fmt: skip


def evaluate_command(capsys, *args):
    """(exit status, stdout, stderr) of python -m ttt.evaluate args."""
    capsys.readouterr()  # what came before (a fixture's training run) is not the command's
    status = main([str(arg) for arg in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def expected_position_losses(run) -> dict[str, np.ndarray]:
    """Mean next-token loss at each position of the test slices of SEQ_LEN + 1 tokens, read directly by the
    model with and without test-time training (BOS targets left out of the inner steps) at the inner
    learning rates of the run's step (2 of a warm-up of 4)."""
    learner, cfg = load(run)
    cfg.data.seq_len, cfg.trainer.test_tasks, cfg.trainer.eval_batch_size = SEQ_LEN, 4, 2
    data = load_builder(cfg.builder).build_data(cfg, learner.tokenizer)
    data.setup("test")
    sums = {}
    for batch in data.test_dataloader():
        for mode, adapt in (("adapted", True), ("unadapted", False)):
            _, losses = learner.model.read(
                batch["tokens"], adapt=adapt, outer_grad=False, lr_scale=0.55, loss_mask=batch["loss_mask"]
            )
            sums[mode] = sums.get(mode, 0) + losses.sum(0)
    return {mode: (total / 4).numpy() for mode, total in sums.items()}


def test_loss_by_position_of_runs_at_another_length_with_and_without_ttt(lm_run, tmp_path, capsys):
    out = tmp_path / "eval"
    status, printed, err = evaluate_command(capsys, lm_run, lm_run, "--out", out, *OVERRIDES)
    assert status == 0, err
    rows = list(csv.DictReader((out / "lm" / "nll_by_position.csv").open()))
    assert len(rows) == SEQ_LEN
    expected = expected_position_losses(lm_run)
    for mode in ("adapted", "unadapted"):
        got = np.array([float(row[f"nll_{mode}"]) for row in rows])
        np.testing.assert_allclose(got, expected[mode], rtol=1e-5, atol=1e-6)
    assert not np.allclose(expected["adapted"][16:], expected["unadapted"][16:])
    for name in ("loss_by_position.csv", "loss_by_position.png", "late_loss_by_window.csv"):
        assert (out / "lm" / name).is_file() and (out / "lm-2" / name).is_file()
    for name in ("loss_by_position_compare.png", "loss_by_position_compare.md", "late_loss_paired.md"):
        assert (out / name).is_file()
    table = (out / "loss_by_position_compare.md").read_text()
    assert "| lm |" in table and "| lm (no TTT) |" in table and "| lm-2 |" in table
    assert "| curve |" in printed


@pytest.mark.parametrize(
    "case, message",
    [
        ("model override", re.escape("'model.window=4': an evaluation takes key=value overrides of data.*")),
        ("bad value", "data.seq_len"),
        ("too long", r"trainer.test_tasks=4 but the test documents make \d slices"),
        ("no checkpoint", "has no checkpoint"),
    ],
)
def test_bad_input_exits_with_status_2(case, message, lm_run, tmp_path, capsys):
    run, overrides = lm_run, list(OVERRIDES)
    if case == "model override":
        overrides.append("model.window=4")
    elif case == "bad value":
        overrides.append("data.seq_len=one")
    elif case == "too long":
        overrides.append("data.seq_len=400")
    else:
        run = shutil.copytree(lm_run, tmp_path / "no_checkpoint", ignore=shutil.ignore_patterns("*.ckpt"))
    status, _, err = evaluate_command(capsys, run, "--out", tmp_path / "eval", *overrides)
    assert status == 2 and re.search(message, err) and "Traceback" not in err, err
