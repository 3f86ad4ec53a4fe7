"""The ttt_e2e recipe end to end at toy size through the command line: the run directory gets the
summary, loss by position and passkey files, with and without test-time training."""

import csv
import json

import pytest
import yaml
from tiny_configs import tiny_text_run, write_tiny_corpus

from recipes import load_config
from ttt.train import main


@pytest.fixture
def tiny_ttt_e2e(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    return tiny_text_run("ttt_e2e", corpus, tmp_path / "runs")


def test_tiny_ttt_e2e_run_writes_long_context_figures(tiny_ttt_e2e, tmp_path):
    assert main([*tiny_ttt_e2e, "run.name=ttt"]) == 0
    run = tmp_path / "runs" / "ttt"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outer_steps"] == 2
    for key in ("query_loss", "late_loss", "passkey_exact_120", "passkey_token_120"):
        assert {f"{key}_adapted", f"{key}_unadapted"} <= set(summary)
    assert summary["query_loss_adapted"] != summary["query_loss_unadapted"]
    logged = list(csv.DictReader((run / "logs" / "version_0" / "metrics.csv").open()))
    late = [float(r["val/late_loss_adapted"]) for r in logged if r.get("val/late_loss_adapted")]
    assert late and all(value > 0 for value in late), "every validation logs the late-position loss"
    rows = list(csv.DictReader((run / "loss_by_position.csv").open()))
    assert len(rows) == 4 and set(rows[0]) == {"start", "end", "loss_adapted", "loss_unadapted"}
    assert rows[-1]["end"] == "47"
    windows = list(csv.DictReader((run / "late_loss_by_window.csv").open()))
    assert len(windows) == 2 and len({row["window"] for row in windows}) == 2
    for mode in ("adapted", "unadapted"):  # equal windows: their mean is the summary's late loss
        mean = sum(float(row[f"late_loss_{mode}"]) for row in windows) / len(windows)
        assert mean == pytest.approx(summary[f"late_loss_{mode}"], rel=1e-5)
    assert (run / "loss_by_position.png").stat().st_size > 0 and (run / "passkey.png").stat().st_size > 0


def test_full_attention_baseline_without_ttt_runs(tiny_ttt_e2e, tmp_path):
    overrides = [
        *tiny_ttt_e2e,
        "run.name=base",
        "ttt.enabled=false",
        "model.window=null",
        "eval.passkey_lengths=[]",
    ]
    assert main(overrides) == 0
    summary = json.loads((tmp_path / "runs" / "base" / "summary.json").read_text())
    assert summary["query_loss_adapted"] == summary["query_loss_unadapted"]
    assert not (tmp_path / "runs" / "base" / "passkey.csv").exists()


@pytest.mark.slow
def test_reading_a_batch_in_several_passes_trains_the_same(tiny_ttt_e2e, tmp_path):
    """ttt.sequences_per_pass only trades memory for speed: one pass per sequence gives the same run."""
    summaries = []
    for per_pass in ("null", "1"):
        assert main([*tiny_ttt_e2e, f"run.name=p{per_pass}", f"ttt.sequences_per_pass={per_pass}"]) == 0
        summaries.append(json.loads((tmp_path / "runs" / f"p{per_pass}" / "summary.json").read_text()))
    for key in ("query_loss_adapted", "query_loss_unadapted", "late_loss_adapted"):
        assert summaries[1][key] == pytest.approx(summaries[0][key], rel=1e-5)


def test_ttt_e2e_config_errors_name_the_key(tiny_ttt_e2e):
    with pytest.raises(ValueError, match="ttt.chunk_len"):
        load_config([*tiny_ttt_e2e, "ttt.chunk_len=0"])
    with pytest.raises(ValueError, match="ttt.sequences_per_pass"):
        load_config([*tiny_ttt_e2e, "ttt.sequences_per_pass=0"])
    with pytest.raises(ValueError, match="did you mean 'suffix_len'"):
        load_config([*tiny_ttt_e2e, "ttt.sufix_len=2"])


def test_ttt_divergence_names_the_pass_and_stops(tiny_ttt_e2e, tmp_path, capsys):
    from ttt.train import DIVERGED

    diverging = ["run.name=nan", "inner.lr=1e30", "inner.grad_clip=null", "ttt.sequences_per_pass=1"]
    assert main([*tiny_ttt_e2e, *diverging]) == DIVERGED
    err = capsys.readouterr().err
    assert "diverged at outer step" in err and "train/loss = " in err and "inner.lr" in err
    assert "loss non-finite in" in err and "passes" in err
    assert not (tmp_path / "runs" / "nan" / "checkpoints" / "last.ckpt").exists()


def test_a_run_trained_short_continues_at_a_longer_context(tiny_ttt_e2e, tmp_path):
    """The short-then-long context schedule: resume with a longer data.seq_len (fewer rows per step, so
    the same bytes per step); the weights, optimizer and lr schedule carry over, and each session's own
    config stays beside its metrics."""
    short = [
        *tiny_ttt_e2e,
        "run.name=ext",
        "data.seq_len=32",
        "trainer.meta_batch_size=4",
        "optim.schedule_steps=4",
    ]
    assert main(short) == 0
    run = tmp_path / "runs" / "ext"
    assert main([f"resume={run}", "data.seq_len=64", "trainer.meta_batch_size=2", "trainer.max_steps=4"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outer_steps"] == 4
    sessions = [
        yaml.safe_load((run / "logs" / v / "hparams.yaml").read_text()) for v in ("version_0", "version_1")
    ]
    assert [(s["data"]["seq_len"], s["trainer"]["meta_batch_size"]) for s in sessions] == [(32, 4), (64, 2)]
    assert yaml.safe_load((run / "config.yaml").read_text()) == sessions[1]
    rows = list(csv.DictReader((run / "loss_by_position.csv").open()))
    assert rows[-1]["end"] == "63", "the test after the long session reads the long windows"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_125m_recipe_at_toy_size_trains_on_masked_slices_and_writes_every_position(tmp_path, precision):
    """recipe=ttt_e2e_125m with its options on (QK-norm, post-norms, stream packing with BOS masking, chunk
    means, fixed inner lr) shrunk to seconds: the held-out objective is logged, and the test writes the
    loss of every one of the seq_len positions. bf16-mixed is the recipe's own precision (CPU autocast
    here): QK-norm once handed the attention float32 q, k beside a bf16 v there."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    overrides = [
        *tiny_text_run("ttt_e2e_125m", corpus, tmp_path / "runs"),
        "model.vocab_size=257", "model.d_ff=48", "model.n_heads=2", "data.seq_len=32", "ttt.chunk_len=8",
        "ttt.sequences_per_pass=1", "eval.passkey_lengths=[120]", f"trainer.precision={precision}",
        "optim.schedule_steps=2", "run.name=e2e",
    ]  # fmt: skip
    cfg = load_config(overrides)
    assert cfg.model.qk_norm and cfg.model.post_norm and cfg.data.packing == "stream"
    assert main(overrides) == 0
    run = tmp_path / "runs" / "e2e"
    summary = json.loads((run / "summary.json").read_text())
    assert {"loss_adapted", "loss_unadapted"} <= set(summary)
    rows = list(csv.DictReader((run / "nll_by_position.csv").open()))
    assert len(rows) == 32 and set(rows[0]) == {"position", "nll_adapted", "nll_unadapted"}
    assert all(float(row["nll_adapted"]) > 0 for row in rows)
