"""data.passkey_fraction: passkey sequences mixed into the text recipes' training windows (train split
only), drawn per row from the task's own generator; 0 leaves every batch as it was."""

import json
import pickle
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_configs import text_data_overrides, tiny_text_run, write_tiny_corpus

from recipes import load_config
from recipes.ttt_e2e import build_data
from ttt.meta.data import TRAIN_STREAM, task_rng
from ttt.text.corpus import TextDataConfig, split_windows
from ttt.text.passkey import QUESTION
from ttt.text.tokenizer import ByteTokenizer
from ttt.train import main

SEQ_LEN = 120
"""Long enough for a 5-digit passkey in bytes (the needle, question and answer take 102)."""
PASSKEY_ROW = re.compile(
    rf"The pass key is (\d{{5}})\. Remember it\. \1 is the pass key\. .*{re.escape(QUESTION)}\1", re.S
)
"""A passkey row: the needle somewhere, the question and the same key at the very end."""


def _config(corpus, *overrides, recipe="ttt_e2e"):
    data = text_data_overrides(corpus, seq_len=SEQ_LEN, meta_batch_size=8, max_steps=50)
    return load_config([f"recipe={recipe}", *data, *overrides])


def _rows(loader) -> np.ndarray:
    return torch.cat([batch["tokens"] for batch in loader]).numpy()


def _train_rows(corpus, *overrides) -> np.ndarray:
    """The 400 training rows (50 steps of 8) of ttt_e2e on `corpus` with `overrides`."""
    return _rows(build_data(_config(corpus, *overrides), ByteTokenizer()).train_dataloader())


def _text(row: np.ndarray) -> str:
    return bytes(row.astype(np.uint8)).decode()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.mark.parametrize("recipe", ["ttt_e2e", "neural_memory", "sophia_lm", "ttt_pretrained_toy"])
def test_default_fraction_zero_gives_the_plain_windows(corpus, recipe):
    cfg = _config(corpus, recipe=recipe)
    assert cfg.data.passkey_fraction == 0.0
    data = build_data(cfg, ByteTokenizer())
    windows = split_windows(cfg.data, ByteTokenizer())
    train = _rows(data.train_dataloader())
    assert train.shape == (400, SEQ_LEN)
    plain = [windows["train"].sample(task_rng(cfg.seed, TRAIN_STREAM, i))["tokens"] for i in range(400)]
    np.testing.assert_array_equal(train, np.stack(plain))


def test_fraction_one_trains_on_passkeys_only_and_leaves_val_and_test_alone(corpus):
    mixed = build_data(_config(corpus, "data.passkey_fraction=1.0"), ByteTokenizer())
    plain = build_data(_config(corpus), ByteTokenizer())
    rows = _rows(mixed.train_dataloader())
    assert rows.shape == (400, SEQ_LEN) and rows.dtype == np.int64
    texts = [_text(row) for row in rows]
    assert all(PASSKEY_ROW.search(text) and text.endswith(QUESTION + text[-5:]) for text in texts)
    assert len({text[-5:] for text in texts}) > 300, "each row draws its own key"
    assert len({text.index("The pass key") for text in texts}) > 10, "and its own depth"
    for split in ("val", "test"):
        loaders = [getattr(data, f"{split}_dataloader")() for data in (mixed, plain)]
        np.testing.assert_array_equal(*map(_rows, loaders))
        assert not any("pass key" in _text(row) for row in _rows(loaders[0]))


def test_an_intermediate_fraction_mixes_that_share_and_keeps_the_other_windows(corpus):
    mixed, plain = _train_rows(corpus, "data.passkey_fraction=0.3"), _train_rows(corpus)
    is_passkey = np.array([bool(PASSKEY_ROW.search(_text(row))) for row in mixed])
    assert 0.23 < is_passkey.mean() < 0.37  # 400 rows: 0.3 +- 3 standard deviations
    np.testing.assert_array_equal(mixed[~is_passkey], plain[~is_passkey])
    assert not (mixed[is_passkey] == plain[is_passkey]).all(1).any()
    np.testing.assert_array_equal(mixed, _train_rows(corpus, "data.passkey_fraction=0.3"))


def test_two_processes_read_the_rows_of_one(corpus):
    """DDP: with 2 processes of 4 rows, step s of process r is rows [8s + 4r, 8s + 4r + 4) of one process
    of 8, passkeys included (a row depends on its task index alone); the sampler pickles (DataLoader
    workers)."""
    one = _train_rows(corpus, "data.passkey_fraction=0.5")
    per_rank = []
    for rank in range(2):
        data = build_data(
            _config(corpus, "data.passkey_fraction=0.5", "trainer.meta_batch_size=4"), ByteTokenizer()
        )
        data.trainer = SimpleNamespace(global_rank=rank, world_size=2, global_step=0)
        per_rank.append(_rows(data.train_dataloader()).reshape(50, 4, SEQ_LEN))
    np.testing.assert_array_equal(np.concatenate(per_rank, axis=1).reshape(400, SEQ_LEN), one)
    mix = pickle.loads(pickle.dumps(data.samples["train"]))
    np.testing.assert_array_equal(mix(task_rng(0, TRAIN_STREAM, 5))["tokens"], one[5])


def test_bad_passkey_fractions_name_the_key(corpus):
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="data.passkey_fraction must be in \\[0, 1\\]"):
            TextDataConfig(passkey_fraction=bad)
    with pytest.raises(ValueError, match="data.passkey_fraction"):
        load_config(["recipe=ttt_e2e", "data.passkey_fraction=2"])
    short = _config(corpus, "data.passkey_fraction=0.5", "data.seq_len=48")
    with pytest.raises(ValueError, match="data.passkey_fraction=0.5 needs .* data.seq_len=48 .*too short"):
        build_data(short, ByteTokenizer())


def test_tiny_ttt_e2e_trains_on_a_passkey_mix(corpus, tmp_path):
    overrides = tiny_text_run(
        "ttt_e2e", corpus, tmp_path, "run.name=mix", f"data.seq_len={SEQ_LEN}", "data.passkey_fraction=0.5"
    )
    assert main(overrides) == 0
    summary = json.loads((tmp_path / "mix" / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and np.isfinite(summary["query_loss_adapted"])
    assert "passkey_exact_120_adapted" in summary


def test_answer_weight_marks_the_positions_that_predict_the_key(corpus):
    """data.passkey_answer_weight: every training row carries loss_weight (seq_len - 1,), the weight where
    a passkey row's position predicts a key token and 1 elsewhere; the tokens are those of the unweighted
    mix; validation and test carry none."""
    cfg = _config(corpus, "data.passkey_fraction=0.5", "data.passkey_answer_weight=50")
    data = build_data(cfg, ByteTokenizer())
    batches = list(data.train_dataloader())
    tokens = torch.cat([batch["tokens"] for batch in batches]).numpy()
    weights = torch.cat([batch["loss_weight"] for batch in batches]).numpy()
    assert weights.shape == (400, SEQ_LEN - 1) and weights.dtype == np.float32
    np.testing.assert_array_equal(tokens, _train_rows(corpus, "data.passkey_fraction=0.5"))
    for row, weight in zip(tokens, weights):
        heavy = np.flatnonzero(weight != 1)
        if PASSKEY_ROW.search(_text(row)):
            assert list(heavy) == list(range(SEQ_LEN - 6, SEQ_LEN - 1)) and (weight[heavy] == 50).all()
            assert _text(row[heavy + 1]) == _text(row)[-5:]  # the positions predict the key's digits
        else:
            assert heavy.size == 0
    assert "loss_weight" not in next(iter(data.val_dataloader()))


def test_the_outer_loss_is_each_rows_weighted_mean():
    """TTTLanguageLearner.pass_loss with loss_weight: the weighted mean of each row's next-token losses,
    summed over rows and divided by the batch size; without it, the plain mean."""
    from ttt.learners.ttt_language_model import TTTLanguageLearner

    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 10.0]])
    model = SimpleNamespace(
        token_losses=lambda tokens, lr_scale, loss_mask: losses,
        ttt_cfg=SimpleNamespace(
            lr_scale=lambda step: 1.0, sequences_per_pass=None, loss_average="tokens", chunk_len=3
        ),
    )
    learner = SimpleNamespace(model=model, inner_lr_scale=lambda: 1.0)
    learner.objective = lambda losses, mask: TTTLanguageLearner.objective(learner, losses, mask)
    weight = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 4.0]])
    loss, _ = TTTLanguageLearner.pass_loss(learner, {"tokens": None, "loss_weight": weight}, batch_size=4)
    assert loss.item() == pytest.approx((2.0 + (4 + 4 + 40) / 6) / 4)
    plain, _ = TTTLanguageLearner.pass_loss(learner, {"tokens": None}, batch_size=4)
    assert plain.item() == pytest.approx((2.0 + 6.0) / 4)
    passes = TTTLanguageLearner.split_passes(learner, {"tokens": torch.zeros(2, 4), "loss_weight": weight})
    assert len(passes) == 1 and set(passes[0]) == {"tokens", "loss_weight"}


def test_bad_answer_weights_name_the_key(corpus):
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="data.passkey_answer_weight must be a finite number > 0"):
            TextDataConfig(passkey_fraction=0.5, passkey_answer_weight=bad)
    with pytest.raises(ValueError, match="data.passkey_answer_weight=10 weights passkey rows.*fraction is 0"):
        TextDataConfig(passkey_answer_weight=10)
    with pytest.raises(ValueError, match="data.passkey_answer_weight=10.0 is not supported by sophia_lm"):
        from recipes import load_builder

        load_builder("sophia_lm").build(
            _config(corpus, "data.passkey_fraction=0.5", "data.passkey_answer_weight=10", recipe="sophia_lm")
        )


def test_tiny_ttt_e2e_trains_with_weighted_answers(corpus, tmp_path):
    overrides = tiny_text_run(
        "ttt_e2e",
        corpus,
        tmp_path,
        "run.name=weighted",
        f"data.seq_len={SEQ_LEN}",
        "data.passkey_fraction=0.5",
        "data.passkey_answer_weight=100",
    )
    assert main(overrides) == 0
    summary = json.loads((tmp_path / "weighted" / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and np.isfinite(summary["query_loss_adapted"])
