"""Text pieces of the long-context recipes: tokenizers, local corpora through `datasets`, token windows,
passkey sequences and scoring, the loss-by-position binning, and the comparison of runs (curves and
window-by-window late losses)."""

import importlib.util
import json

import numpy as np
import pytest
import torch
from tables import markdown_tables

from ttt.text.corpus import TextDataConfig, TokenWindows, corpus_files, load_documents, split_windows
from ttt.text.long_context import LongContextEvalConfig, bin_positions, passkey_accuracy, window_ids
from ttt.text.passkey import sample_passkey
from ttt.text.tokenizer import ByteTokenizer, load_tokenizer


def test_byte_tokenizer_is_utf8():
    ids = ByteTokenizer().encode("hé!")
    assert ids.tolist() == [104, 195, 169, 33] and ids.dtype == np.int32
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_tokenizer_errors_name_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers is not installed")
def test_local_tokenizer_json_loads(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.vocab_size == 3 and loaded.encode("hello world zzz").tolist() == [0, 1, 2]


def test_stdlib_corpus_is_the_standard_library_source():
    files = corpus_files("stdlib")
    assert len(files) > 100
    assert any(f.endswith("/os.py") for f in files) and not any("site-packages" in f for f in files)


@pytest.fixture
def text_dir(tmp_path):
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(6):
        (root / f"doc{i}.txt").write_text(f"document {i} " + "abcdefghij" * (3 + i))
    return root


def test_local_text_json_and_parquet_corpora_load(text_dir, tmp_path):
    texts = load_documents(TextDataConfig(corpus=str(text_dir)))
    assert len(texts) == 6 and texts[0].startswith("document 0 ")
    records = [{"body": t} for t in texts]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    assert load_documents(TextDataConfig(corpus=str(tmp_path / "c.jsonl"), text_field="body")) == texts
    import datasets

    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "c.parquet"))
    assert load_documents(TextDataConfig(corpus=str(tmp_path / "c.parquet"), text_field="body")) == texts
    assert len(load_documents(TextDataConfig(corpus=str(text_dir), max_documents=3))) == 3
    with pytest.raises(ValueError, match="data.text_field='text'.*body"):
        load_documents(TextDataConfig(corpus=str(tmp_path / "c.jsonl")))


def test_bad_corpora_fail_clearly(text_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="data.corpus=.*no files found"):
        load_documents(TextDataConfig(corpus=str(tmp_path / "nothing*.txt")))
    (text_dir / "extra.parquet").write_text("x")
    with pytest.raises(ValueError, match="must all be text"):
        load_documents(TextDataConfig(corpus=str(text_dir)))
    with pytest.raises(ValueError, match="data.seq_len"):
        TextDataConfig(seq_len=1)


def test_windows_lie_inside_one_document_and_splits_are_disjoint(text_dir):
    cfg = TextDataConfig(corpus=str(text_dir), seq_len=30, held_out_every=3)
    windows = split_windows(cfg, ByteTokenizer())
    assert [len(windows[s].documents) for s in ("train", "val", "test")] == [2, 2, 2]
    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens = windows["val"].sample(rng)["tokens"]
        text = bytes(tokens.astype(np.uint8)).decode()
        assert tokens.shape == (30,) and tokens.dtype == np.int64
        assert any(text in bytes(d.astype(np.uint8)).decode() for d in windows["val"].documents)
    first = windows["train"].sample(np.random.default_rng(7))["tokens"]
    np.testing.assert_array_equal(first, windows["train"].sample(np.random.default_rng(7))["tokens"])
    with pytest.raises(ValueError, match="no train document has data.seq_len=500"):
        TokenWindows([np.zeros(10, np.int32)], 500, "train")


def test_passkey_sequence_hides_the_key_and_marks_the_answer():
    tokenizer = ByteTokenizer()
    sample = sample_passkey(tokenizer, 300, 5, np.random.default_rng(3))
    tokens, mask = sample["tokens"], sample["answer_mask"]
    assert tokens.shape == mask.shape == (300,) and mask.sum() == 5
    text = bytes(tokens.astype(np.uint8)).decode()
    key = text[-5:]
    assert key.isdigit() and f"The pass key is {key}. Remember it." in text[:-5]
    answer_positions = np.flatnonzero(mask)
    assert bytes(tokens[answer_positions + 1].astype(np.uint8)).decode() == key
    with pytest.raises(ValueError, match="too short"):
        sample_passkey(tokenizer, 40, 5, np.random.default_rng(0))


class _ZeroIsTwoTokens(ByteTokenizer):
    """Bytes, except that the digit 0 takes two tokens: keys then differ in token count."""

    def encode(self, text: str) -> np.ndarray:
        return np.concatenate([[48, 48] if ch == "0" else ByteTokenizer.encode(self, ch) for ch in text])


def test_passkey_accuracy_scores_each_trial_on_its_own_answer():
    tokenizer = _ZeroIsTwoTokens()
    cfg = LongContextEvalConfig(passkey_lengths=[200], passkey_trials=6, passkey_digits=4)
    samples = [sample_passkey(tokenizer, 200, 4, np.random.default_rng([0, 200, t])) for t in range(6)]
    masks = torch.from_numpy(np.stack([sample["answer_mask"] for sample in samples]))
    answer_lengths = masks.sum(1)
    assert len(set(answer_lengths.tolist())) > 1  # the trials' answers differ in token count

    def read(tokens, adapt):
        """Adapted: right on each trial's own answer positions only, except trial 0's last answer
        token; unadapted: wrong everywhere."""
        right = torch.nn.functional.one_hot(torch.roll(tokens, -1, dims=1), 256).float()
        wrong = right.roll(1, dims=-1)
        if not adapt:
            return wrong, None
        logits = torch.where(masks[..., None], right, wrong)
        logits[0, -2] = wrong[0, -2]
        return logits, None

    (row,) = passkey_accuracy(read, tokenizer, cfg, seed=0, device=torch.device("cpu"))
    assert row["exact_adapted"] == pytest.approx(5 / 6) and row["exact_unadapted"] == 0
    first = 1 - 1 / answer_lengths[0].item()
    assert row["token_adapted"] == pytest.approx((5 + first) / 6) and row["token_unadapted"] == 0
    assert row["first_adapted"] == 1 and row["first_unadapted"] == 0, "trial 0 missed its last token only"


def test_first_answer_token_accuracy_looks_at_each_trial_s_own_first_answer_position():
    tokenizer = _ZeroIsTwoTokens()
    cfg = LongContextEvalConfig(passkey_lengths=[200], passkey_trials=6, passkey_digits=4)
    samples = [sample_passkey(tokenizer, 200, 4, np.random.default_rng([0, 200, t])) for t in range(6)]
    masks = torch.from_numpy(np.stack([sample["answer_mask"] for sample in samples]))
    openings = masks.int().argmax(1)

    def read(tokens, adapt):
        """Right everywhere, except the first answer token of trials 1 and 4 (adapted) or of all
        trials (unadapted)."""
        right = torch.nn.functional.one_hot(torch.roll(tokens, -1, dims=1), 256).float()
        logits = right.clone()
        for trial in [1, 4] if adapt else range(6):
            logits[trial, openings[trial]] = right[trial, openings[trial]].roll(1, dims=-1)
        return logits, None

    (row,) = passkey_accuracy(read, tokenizer, cfg, seed=0, device=torch.device("cpu"))
    assert row["first_adapted"] == pytest.approx(4 / 6) and row["first_unadapted"] == 0
    assert row["exact_adapted"] == pytest.approx(4 / 6) and row["exact_unadapted"] == 0


def test_loss_by_position_bins():
    rows = bin_positions(np.arange(10, dtype=float), 4)
    assert [(r["start"], r["end"]) for r in rows] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert rows[0]["loss"] == 0.5 and rows[-1]["loss"] == 8.0
    with pytest.raises(ValueError, match="eval.late_fraction"):
        LongContextEvalConfig(late_fraction=0)


def test_compare_overlays_runs(tmp_path, capsys):
    from ttt.text.compare import main

    rows = [{"start": 0, "end": 4, "loss": 2.0}, {"start": 4, "end": 8, "loss": 1.5}]
    for name, unadapted in (("ttt", [{**rows[0]}, {**rows[1], "loss": 1.8}]), ("base", rows)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "loss_by_position.json").write_text(
            json.dumps({"adapted": rows, "unadapted": unadapted})
        )
    assert main([str(tmp_path / "ttt"), str(tmp_path / "base"), "--out", str(tmp_path / "cmp")]) == 0
    (table,) = markdown_tables((tmp_path / "cmp" / "loss_by_position_compare.md").read_text())
    assert list(table) == ["ttt", "ttt (no TTT)", "base"], "a run without TTT has one curve"
    assert [float(table["ttt (no TTT)"][b]) for b in ("0-4", "4-8")] == [2.0, 1.8]
    assert [float(table["base"][b]) for b in ("0-4", "4-8")] == [2.0, 1.5]
    assert (tmp_path / "cmp" / "loss_by_position_compare.png").is_file()
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path / "cmp")]) == 2
    assert "no loss_by_position.json" in capsys.readouterr().err


def test_window_ids_name_each_window_by_its_tokens():
    tokens = torch.tensor([[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    ids = window_ids(tokens)
    assert ids.dtype == torch.int64 and ids.shape == (3,) and bool((ids >= 0).all())
    assert ids[0] == ids[2] and ids[0] != ids[1]
    assert torch.equal(window_ids(tokens.to(torch.int32)), ids), "the id does not depend on the dtype"


def _write_window_run(folder, losses: dict[str, float], unadapted: dict[str, float] | None = None):
    """A run directory with loss_by_position.json and late_loss_by_window.csv (window id -> late loss)."""
    rows = [{"start": 0, "end": 4, "loss": 1.0}]
    folder.mkdir()
    changed = [{**rows[0], "loss": 2.0}] if unadapted else rows
    (folder / "loss_by_position.json").write_text(json.dumps({"adapted": rows, "unadapted": changed}))
    lines = ["window,late_loss_adapted,late_loss_unadapted"]
    lines += [f"{w},{loss},{(unadapted or losses)[w]}" for w, loss in losses.items()]
    (folder / "late_loss_by_window.csv").write_text("\n".join(lines) + "\n")


def test_compare_pairs_late_losses_window_by_window(tmp_path, capsys):
    from ttt.text.compare import main

    _write_window_run(tmp_path / "full", {"a": 1.0, "b": 2.0, "c": 3.0})
    _write_window_run(tmp_path / "ttt", {"a": 0.5, "b": 1.5, "c": 3.5}, unadapted={"a": 1, "b": 2, "c": 3})
    _write_window_run(tmp_path / "other", {"a": 1.0, "d": 2.0, "c": 3.0})
    runs = [str(tmp_path / name) for name in ("full", "ttt", "other")]
    assert main([*runs, "--out", str(tmp_path / "cmp")]) == 0
    text = (tmp_path / "cmp" / "late_loss_paired.md").read_text()
    assert text in capsys.readouterr().out
    (table,) = markdown_tables(text)
    assert float(table["full"]["late loss"]) == 2.0 and table["full"]["minus full"] == ""
    # differences -0.5, -0.5, +0.5: mean -1/6, standard error std(ddof=1) / sqrt(3) = (1/sqrt(3)) / sqrt(3)
    ttt = table["ttt"]
    assert float(ttt["late loss"]) == pytest.approx(11 / 6, abs=1e-4)
    assert float(ttt["minus full"]) == pytest.approx(-1 / 6, abs=1e-4)
    assert float(ttt["standard error"]) == pytest.approx(1 / 3, abs=1e-4) and ttt["windows lower"] == "2 of 3"
    no_ttt = table["ttt (no TTT)"]
    assert float(no_ttt["minus full"]) == 0 and no_ttt["windows lower"] == "0 of 3"
    assert "not paired" in table["other"]["minus full"], "runs read on other test windows are not paired"
    assert not (tmp_path / "cmp" / "runs_compare.md").exists(), "no run has a summary.json"
    # A run directory without late_loss_by_window.csv compares without the paired table.
    (tmp_path / "full" / "late_loss_by_window.csv").unlink()
    assert main([runs[0], "--out", str(tmp_path / "old")]) == 0
    assert not (tmp_path / "old" / "late_loss_paired.md").exists()


def test_compare_tabulates_the_runs_summaries(tmp_path):
    from ttt.text.compare import main

    summaries = {
        "full": {
            "outer_steps": 10,
            "training_time_s": 12.4,
            "peak_memory_gib": 1.3,
            "late_loss_adapted": 2.0,
            "late_loss_unadapted": 2.0,
            "passkey_exact_64_adapted": 0.5,
            "passkey_exact_128_adapted": 0.25,
            "passkey_token_128_adapted": 0.75,
        },
        "ttt": {"outer_steps": 10, "late_loss_adapted": 1.5, "late_loss_unadapted": 1.8},
    }
    for name, summary in summaries.items():
        _write_window_run(tmp_path / name, {"a": 1.0})
        (tmp_path / name / "summary.json").write_text(json.dumps(summary))
    assert main([str(tmp_path / "full"), str(tmp_path / "ttt"), "--out", str(tmp_path / "cmp")]) == 0
    (table,) = markdown_tables((tmp_path / "cmp" / "runs_compare.md").read_text())
    full, ttt = table["full"], table["ttt"]
    assert int(full["outer steps"]) == 10 and float(full["training time (s)"]) == pytest.approx(12.4, abs=0.5)
    assert float(full["peak memory (GiB)"]) == 1.3 and float(full["late loss"]) == 2.0
    assert full["without TTT"] == "-", "a run without TTT has one late loss"
    # the passkey columns take the longest length tested
    assert int(full["passkey length"]) == 128
    assert float(full["passkey exact"]) == 0.25 and float(full["key digits"]) == 0.75
    assert float(ttt["late loss"]) == 1.5 and float(ttt["without TTT"]) == 1.8
    assert [ttt[key] for key in ("training time (s)", "peak memory (GiB)", "passkey length")] == ["-"] * 3


def test_compare_plots_validation_against_steps_and_training_time(tmp_path):
    from ttt.text.compare import load_validation, main

    _write_window_run(tmp_path / "ttt", {"a": 1.0}, unadapted={"a": 2.0})
    logs = tmp_path / "ttt" / "logs" / "version_0"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text(
        "epoch,step,train/time_s,val/late_loss_adapted,val/late_loss_unadapted\n"
        "0,4,1.5,,\n0,9,3.0,,\n0,9,,2.5,2.75\n1,14,4.5,,\n1,19,6.0,,\n1,19,,2.0,2.5\n"
    )
    assert load_validation(tmp_path / "ttt") == {
        "ttt": [(9, 3.0, 2.5), (19, 6.0, 2.0)],
        "ttt (no TTT)": [(9, 3.0, 2.75), (19, 6.0, 2.5)],
    }
    assert main([str(tmp_path / "ttt"), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "validation_compare.png").stat().st_size > 0
