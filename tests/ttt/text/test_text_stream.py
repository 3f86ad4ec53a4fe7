"""Decoding token ids back to text, whole and one id at a time (`TextStream`): characters cut between
ids wait for their last byte, what is not UTF-8 becomes U+FFFD, and the pieces add up to the whole."""

import pytest

from ttt.text.tokenizer import REPLACEMENT, ByteTokenizer, JsonTokenizer, TextStream

TEXT = "naïve café ☃ — 漢字 done\n"


def streamed(tokenizer, ids):
    """The pieces a TextStream gives for ids, and its finish."""
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    return pieces, stream.finish()


def test_bytes_decode_whole_and_streamed_without_cutting_a_character():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(TEXT).tolist()
    assert tokenizer.decode(ids) == TEXT
    pieces, rest = streamed(tokenizer, ids)
    assert "".join(pieces) + rest == TEXT and rest == ""
    snowman = TEXT.encode().index("☃".encode())
    assert pieces[snowman : snowman + 3] == ["", "", "☃"]  # 3 bytes: given once the last one comes
    assert REPLACEMENT not in "".join(pieces)


def test_bytes_that_are_not_utf8_and_ids_past_the_bytes_become_replacement_characters():
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([0x61, 0xFF, 0x62, 256, 0x63]) == f"a{REPLACEMENT}b{REPLACEMENT}c"
    pieces, rest = streamed(tokenizer, [0x61, 0xFF, 0x62, 0xE2, 0x98])  # a, bad byte, b, 2 of ☃'s 3 bytes
    assert pieces == ["a", "", f"{REPLACEMENT}b", "", ""]
    assert rest == REPLACEMENT
    stuck = [0x80] * 20  # never a character: given out after TextStream.PENDING ids at most
    assert "".join(streamed(tokenizer, stuck)[0]).count(REPLACEMENT) >= 20 - TextStream.PENDING


def test_a_tokenizer_json_streams_what_it_decodes_whole(tmp_path):
    pytest.importorskip("tokenizers")
    from ttt.text.train_tokenizer import train_tokenizer

    documents = ["def parse(text):\n    return text.split()\n", "café naïve ☃ 漢字"] * 20
    train_tokenizer(documents, 300).save(str(tmp_path / "tokenizer.json"))
    tokenizer = JsonTokenizer(tmp_path / "tokenizer.json")
    ids = tokenizer.encode(TEXT).tolist()
    assert tokenizer.decode(ids) == TEXT
    pieces, rest = streamed(tokenizer, ids)
    assert "".join(pieces) + rest == TEXT
    assert REPLACEMENT not in "".join(pieces)
    assert tokenizer.decode([tokenizer.bos_id, *ids[:3]]).startswith("<|begin_of_text|>")
