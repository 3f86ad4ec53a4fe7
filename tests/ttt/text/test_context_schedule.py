"""data.short_seq_len / data.short_steps: the text recipes' short-then-long context schedule. The short
phase reads seq_len / short_seq_len times as many windows of short_seq_len tokens (from every training
document that long), the long phase exactly the windows of a run without the schedule, and validation
and test always the long windows."""

import json

import numpy as np
import pytest
import torch
from tiny_configs import text_data_overrides, tiny_text_run, write_tiny_corpus

from recipes import load_config
from recipes.ttt_e2e import build_data
from ttt.meta.data import TRAIN_STREAM, StepAlignedSampler, task_rng
from ttt.text.context_schedule import ShortThenLong, flatten_rows
from ttt.text.corpus import TextDataConfig, TokenWindows, split_documents
from ttt.text.tokenizer import ByteTokenizer
from ttt.train import main

SEQ_LEN, SHORT = 120, 40


def _config(corpus, *overrides, recipe="ttt_e2e"):
    data = text_data_overrides(corpus, seq_len=SEQ_LEN, meta_batch_size=4, max_steps=10)
    return load_config([f"recipe={recipe}", *data, *overrides])


def _batches(data) -> list[dict[str, torch.Tensor]]:
    return list(data.train_dataloader())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("recipe", ["ttt_e2e", "neural_memory", "sophia_lm", "ttt_pretrained_toy"])
def test_short_steps_read_more_shorter_rows_then_the_plain_windows(corpus, recipe):
    schedule = [f"data.short_seq_len={SHORT}", "data.short_steps=3"]
    if recipe == "neural_memory":
        schedule.append("ttt.chunk_len=20")  # its chunks (64) would be longer than the short windows
    scheduled = _batches(build_data(_config(corpus, *schedule, recipe=recipe), ByteTokenizer()))
    plain = _batches(build_data(_config(corpus, recipe=recipe), ByteTokenizer()))
    assert [tuple(b["tokens"].shape) for b in scheduled] == [(12, SHORT)] * 3 + [(4, SEQ_LEN)] * 7
    for step in range(3, 10):
        torch.testing.assert_close(scheduled[step]["tokens"], plain[step]["tokens"], rtol=0, atol=0)
    cfg = _config(corpus, *schedule, recipe=recipe)
    short = TokenWindows(split_documents(cfg.data, ByteTokenizer())["train"], SHORT, "train")
    for step in range(3):
        rngs = [task_rng(cfg.seed, TRAIN_STREAM, step * 4 + task) for task in range(4)]
        expected = [short.sample(rng)["tokens"] for rng in rngs for _ in range(3)]  # 3 draws per task
        np.testing.assert_array_equal(scheduled[step]["tokens"].numpy(), np.stack(expected))


def test_held_out_sets_keep_the_long_windows(corpus):
    scheduled = build_data(
        _config(corpus, f"data.short_seq_len={SHORT}", "data.short_steps=3"), ByteTokenizer()
    )
    plain = build_data(_config(corpus), ByteTokenizer())
    for split in ("val", "test"):
        loaders = [getattr(data, f"{split}_dataloader")() for data in (scheduled, plain)]
        got, expected = ([b["tokens"] for b in loader] for loader in loaders)
        assert all(t.shape[1] == SEQ_LEN for t in got)
        torch.testing.assert_close(torch.cat(got), torch.cat(expected), rtol=0, atol=0)


def test_two_processes_read_the_rows_of_one_with_twice_the_batch():
    """Tasks come from their index alone, so the DDP shares flattened side by side are the single
    process's batch (the step alignment of `StepAlignedSampler`, now with blocks of rows)."""
    schedule = ShortThenLong(
        lambda rng: {"tokens": rng.integers(0, 256, SHORT)},
        lambda rng: {"tokens": rng.integers(0, 256, SEQ_LEN)},
        short_steps=2,
        rows=3,
    )

    def batches(batch_size, rank, world_size):
        sampler = StepAlignedSampler(4, batch_size, lambda: 0, rank=rank, world_size=world_size)
        indices = list(sampler)
        steps = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
        tasks_per_step = batch_size * world_size

        def task(i):
            return {
                "tokens": torch.from_numpy(
                    schedule(np.random.default_rng([0, i]), i // tasks_per_step)["tokens"]
                )
            }

        return [flatten_rows([task(i) for i in step])["tokens"] for step in steps]

    single = batches(4, 0, 1)
    shares = [batches(2, rank, 2) for rank in (0, 1)]
    for step, whole in enumerate(single):
        assert whole.shape == ((12, SHORT) if step < 2 else (4, SEQ_LEN))
        torch.testing.assert_close(torch.cat([shares[0][step], shares[1][step]]), whole, rtol=0, atol=0)


def test_passkeys_mix_into_both_phases(corpus):
    overrides = [f"data.short_seq_len={SHORT * 3 // 1}", "data.short_steps=3", "data.passkey_fraction=1.0"]
    config = _config(corpus, "data.seq_len=240", *overrides, "data.passkey_answer_weight=10")
    batches = _batches(build_data(config, ByteTokenizer()))
    assert tuple(batches[0]["loss_weight"].shape) == (8, 119) and tuple(batches[5]["loss_weight"].shape) == (
        4,
        239,
    )
    for batch in (batches[0], batches[5]):
        assert (batch["loss_weight"] == 10).sum(1).tolist() == [5] * len(batch["tokens"])


def test_a_schedule_that_never_reaches_the_long_windows_warns(corpus):
    with pytest.warns(UserWarning, match=r"data\.short_steps=10 >= trainer\.max_steps=10: no training step"):
        build_data(_config(corpus, f"data.short_seq_len={SHORT}", "data.short_steps=10"), ByteTokenizer())


def test_a_short_phase_of_one_ttt_chunk_is_refused(corpus):
    config = _config(corpus, "data.short_seq_len=30", "data.short_steps=3", "ttt.chunk_len=30")
    with pytest.raises(ValueError, match=r"data\.short_seq_len=30 is at most one ttt\.chunk_len=30 chunk"):
        build_data(config, ByteTokenizer())
    without_ttt = ["data.short_seq_len=30", "data.short_steps=3", "ttt.chunk_len=30", "ttt.enabled=false"]
    build_data(_config(corpus, *without_ttt), ByteTokenizer())  # no inner steps: nothing to refuse


def test_a_short_phase_too_short_for_a_passkey_names_its_key(corpus):
    config = _config(corpus, f"data.short_seq_len={SHORT}", "data.short_steps=3", "data.passkey_fraction=0.5")
    with pytest.raises(ValueError, match=r"data\.short_seq_len=40 tokens .*raise data\.short_seq_len"):
        build_data(config, ByteTokenizer())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"short_steps": 5}, r"data\.short_steps=5 needs data\.short_seq_len"),
        ({"short_steps": -1}, r"data\.short_steps must be >= 0, got -1"),
        ({"short_seq_len": 50, "short_steps": 5}, r"divide it .* got 50"),
        ({"short_seq_len": 120, "short_steps": 5}, r"below data\.seq_len \(120\) .* got 120"),
        ({"short_seq_len": 1, "short_steps": 5}, r"must be >= 2"),
    ],
)
def test_bad_schedules_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        TextDataConfig(seq_len=SEQ_LEN, **overrides)


def test_short_steps_zero_turns_the_schedule_off(corpus):
    """One key turns a recipe's schedule off (ttt_e2e_16k sets both): the plain batches."""
    off = _batches(
        build_data(_config(corpus, f"data.short_seq_len={SHORT}", "data.short_steps=0"), ByteTokenizer())
    )
    plain = _batches(build_data(_config(corpus), ByteTokenizer()))
    for a, b in zip(off, plain, strict=True):
        torch.testing.assert_close(a["tokens"], b["tokens"], rtol=0, atol=0)


def test_a_scheduled_run_trains_and_tests_at_the_long_length(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    overrides = tiny_text_run(
        "ttt_e2e",
        corpus,
        tmp_path,
        "run.name=sched",
        "trainer.max_steps=4",
        "trainer.steps_per_epoch=2",
        "data.seq_len=64",
        "data.short_seq_len=32",
        "data.short_steps=2",
    )
    assert main(overrides) == 0
    summary = json.loads((tmp_path / "sched" / "summary.json").read_text())
    assert summary["outer_steps"] == 4 and np.isfinite(summary["late_loss_adapted"])


def test_resuming_past_the_time_limit_is_refused_before_the_run_changes(tmp_path, capsys):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    base = tiny_text_run("ttt_e2e", corpus, tmp_path)
    assert main([*base, "run.name=timed", "trainer.max_minutes=10"]) == 0
    run = tmp_path / "timed"
    before = sorted(p.name for p in (run / "logs").iterdir())
    status = main([f"resume={run}", "trainer.max_steps=4", "trainer.max_minutes=0.0001"])
    assert status == 2
    assert "trainer.max_minutes=0.0001 counts the whole run" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "logs").iterdir()) == before
    assert main([f"resume={run}", "trainer.max_steps=4"]) == 0, "the saved limit (10 minutes) still fits"
