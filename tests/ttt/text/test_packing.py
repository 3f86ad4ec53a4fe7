"""data.packing=stream: documents joined with a BOS before each, cut into seq_len + 1-token slices every
seq_len tokens, every slice once per pass in a seeded order, BOS targets masked; the tokenizer's BOS;
the errors a user meets first (a BOS outside the vocabulary, a corpus shorter than one slice, more
held-out slices than the split makes, a tokenizer too large for the model, options that do not mix)."""

import numpy as np
import pytest
from tiny_configs import text_data_overrides, write_tiny_corpus

from recipes import load_config
from recipes.ttt_e2e import build_data, text_tokenizer
from ttt.meta import IndexedSampler
from ttt.text.packing import PackedSlices
from ttt.text.tokenizer import ByteTokenizer
from ttt.text.train_tokenizer import main as train_tokenizer

DOCS = [np.arange(10, 17), np.arange(20, 23), np.arange(30, 39)]  # 7 + 3 + 9 tokens


def test_slices_of_the_bos_joined_stream():
    slices = PackedSlices(DOCS, length=5, bos_id=0, split="train", shuffle=False)
    stream = np.concatenate([[0], DOCS[0], [0], DOCS[1], [0], DOCS[2]])
    assert isinstance(slices, IndexedSampler)
    assert np.array_equal(slices.stream, stream) and len(slices) == (len(stream) - 1) // 5 == 4
    for i in range(4):
        task = slices.task(seed=7, index=i)
        assert np.array_equal(task["tokens"], stream[5 * i : 5 * i + 6])  # the stride is 5: one token shared
        assert np.array_equal(task["loss_mask"], task["tokens"][1:] != 0)
    assert np.array_equal(slices.task(7, 4)["tokens"], slices.task(7, 0)["tokens"])  # the next pass
    assert not slices.task(7, 1)["loss_mask"].all()  # the second document's BOS is a masked target


def test_a_shuffled_pass_reads_every_slice_once_in_a_seeded_order():
    slices = PackedSlices(DOCS * 5, length=4, bos_id=0, split="train", shuffle=True)
    first = [slices.slice_index(3, i) for i in range(len(slices))]
    second = [slices.slice_index(3, i + len(slices)) for i in range(len(slices))]
    assert sorted(first) == sorted(second) == list(range(len(slices)))
    assert first != list(range(len(slices))) and first != second
    assert first == [slices.slice_index(3, i) for i in range(len(slices))]
    assert first != [slices.slice_index(4, i) for i in range(len(slices))]


def test_a_corpus_shorter_than_one_slice_is_refused_by_key():
    with pytest.raises(ValueError, match=r"fewer than one slice of data.seq_len \+ 1 = 41"):
        PackedSlices(DOCS, length=40, bos_id=0, split="val", shuffle=False)


def stream_overrides(corpus, *extra):
    data = text_data_overrides(corpus, seq_len=16, meta_batch_size=2, max_steps=2)
    return ["recipe=ttt_e2e", "data.packing=stream", *data, *extra]


def test_the_recipe_serves_masked_slices_and_checks_its_keys(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    cfg = load_config(stream_overrides(corpus))
    assert ByteTokenizer().bos_id is None  # bytes: the stream's BOS is the first id past the vocabulary, 256
    with pytest.raises(
        ValueError, match=r"data.bos_id \(256\) must be a token id below model.vocab_size \(256\)"
    ):
        text_tokenizer(cfg.data, cfg.model)
    cfg = load_config(stream_overrides(corpus, "model.vocab_size=257"))
    data = build_data(cfg, text_tokenizer(cfg.data, cfg.model))
    batch = next(iter(data.train_dataloader()))
    assert batch["tokens"].shape == (2, 17) and batch["loss_mask"].shape == (2, 16)
    assert (batch["loss_mask"] == (batch["tokens"][:, 1:] != 256)).all()
    assert next(iter(data.val_dataloader()))["tokens"].shape == (4, 17)
    too_many = load_config(stream_overrides(corpus, "model.vocab_size=257", "trainer.test_tasks=500"))
    with pytest.raises(ValueError, match="trainer.test_tasks=500 but the test documents make"):
        build_data(too_many, ByteTokenizer())
    with pytest.raises(ValueError, match="data.bos_id must be"):
        load_config(stream_overrides(corpus, "data.bos_id=-1"))
    with pytest.raises(ValueError, match="does not combine with data.short_steps or data.passkey_fraction"):
        load_config(stream_overrides(corpus, "data.passkey_fraction=0.5"))


def test_a_trained_tokenizer_puts_its_bos_first(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    path = train_tokenizer(["--corpus", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "tok")])
    cfg = load_config(stream_overrides(corpus, f"data.tokenizer={path}", "model.vocab_size=300"))
    tokenizer = text_tokenizer(cfg.data, cfg.model)
    assert 256 < tokenizer.vocab_size <= 300 and tokenizer.bos_id == 0  # a tiny corpus makes fewer merges
    assert 0 not in tokenizer.encode("def f(x): return x")
    texts = ["def f(x): return x", "", "class A:\n    pass\n"]
    batch = tokenizer.encode_batch(texts)  # the corpus is encoded this way, on all cores
    assert [ids.tolist() for ids in batch] == [tokenizer.encode(text).tolist() for text in texts]
    assert all(ids.dtype == np.int32 for ids in batch)
    stream = build_data(cfg, tokenizer).samples["train"].stream
    assert stream[0] == 0 and (stream == 0).sum() == 3  # the 3 training documents (of 9), each after its BOS
    small = load_config(stream_overrides(corpus, f"data.tokenizer={path}", "model.vocab_size=257"))
    with pytest.raises(
        ValueError, match=r"model.vocab_size \(257\) must be >= the tokenizer's vocabulary \(\d+\)"
    ):
        text_tokenizer(small.data, small.model)
    with pytest.raises(SystemExit):
        train_tokenizer(["--corpus", str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
