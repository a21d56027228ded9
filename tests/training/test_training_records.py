"""Byte-level tokenizer and the canonical records blob."""

from __future__ import annotations

import struct

import pytest

from training.errors import BadRecords
from training.records import (
    BOS_ID,
    BYTE_OFFSET,
    EOS_ID,
    HEADER_SIZE,
    PAD_ID,
    VOCAB_SIZE,
    decode_records,
    decode_tokens,
    encode_bytes,
    make_records,
)


def test_tokenizer_maps_each_byte_and_round_trips() -> None:
    data = bytes(range(256))
    tokens = encode_bytes(data)
    assert tokens[0] == BOS_ID
    assert tokens[-1] == EOS_ID
    assert tokens[1:-1] == [b + BYTE_OFFSET for b in data]
    assert max(tokens) == VOCAB_SIZE - 1
    assert decode_tokens(tokens) == data


def test_records_layout_and_padding() -> None:
    blob = make_records([b"abc", b"de"], seq_len=5)
    # stream: BOS a b c EOS BOS d e EOS -> 9 tokens -> 2 records, 1 pad
    records = decode_records(blob)
    assert records.count == 2
    assert records.seq_len == 5
    flat = records.tokens.reshape(-1).tolist()
    assert flat[:6] == [BOS_ID, *(c + BYTE_OFFSET for c in b"abc"), EOS_ID, BOS_ID]
    assert flat[-2:] == [EOS_ID, PAD_ID]
    assert len(blob) == HEADER_SIZE + 10 * 2
    assert make_records([b"abc", b"de"], seq_len=5) == blob


def test_records_reject_malformed() -> None:
    blob = make_records([b"hello"], seq_len=4)
    with pytest.raises(BadRecords, match="magic"):
        decode_records(b"X" + blob[1:])
    with pytest.raises(BadRecords, match="header says"):
        decode_records(blob + b"\0\0")
    with pytest.raises(BadRecords, match="shorter"):
        decode_records(blob[:10])
    out_of_vocab = blob[:HEADER_SIZE] + struct.pack("<H", VOCAB_SIZE) + blob[HEADER_SIZE + 2 :]
    with pytest.raises(BadRecords, match="outside the vocabulary"):
        decode_records(out_of_vocab)
    with pytest.raises(BadRecords, match="seq_len"):
        make_records([b"x"], seq_len=1)
    with pytest.raises(BadRecords, match="no input"):
        make_records([], seq_len=8)


def test_lone_last_token_is_dropped_not_padded() -> None:
    """A record holding only the final EOS has no target: a batch of it alone gave NaN."""
    # BOS + 6 bytes + EOS = 8 tokens = one record of 7 and a lone EOS
    records = decode_records(make_records([b"abcdef"], seq_len=7))
    assert records.count == 1
    assert records.tokens[0, -1] == BYTE_OFFSET + ord("f")


def _toy_tokenizer() -> bytes:
    pytest.importorskip("tokenizers")
    from training.hf_model import train_tokenizer

    texts = ["records are tokenised by the base model's own tokenizer. "] * 8
    return str(train_tokenizer("llama", texts, vocab_size=300).to_str()).encode()


def test_tokenizer_records_are_canonical_and_name_their_tokenizer() -> None:
    from tokenizers import Tokenizer

    from training.records import HEADER_SIZE_V2, make_tokenizer_records

    tok = _toy_tokenizer()
    tok_id = "ab" * 32
    text = "the base model's own tokenizer"
    ids = [*Tokenizer.from_str(tok.decode()).encode(text).ids, 1]
    seq = 8 if len(ids) % 8 not in (0, 1) else 7  # so the last record has padding
    data = make_tokenizer_records(
        [text.encode()], seq, tokenizer_json=tok, tokenizer_id=tok_id, eos_id=1
    )
    records = decode_records(data)
    vocab = Tokenizer.from_str(tok.decode()).get_vocab_size(with_added_tokens=True)
    assert records.tokenizer_id == tok_id and records.vocab_size == vocab
    assert records.pad_id == vocab  # one past the last id: never a real token
    flat = [int(t) for t in records.tokens.reshape(-1)]
    assert flat[: len(ids)] == ids and set(flat[len(ids) :]) == {vocab}
    assert ids[0] == 0  # the Llama-style post-processor put its BOS in front
    # the same inputs give the same bytes; any other header or token is refused
    again = make_tokenizer_records(
        [text.encode()], seq, tokenizer_json=tok, tokenizer_id=tok_id, eos_id=1
    )
    assert again == data
    wide = bytearray(data)
    wide[8] = 4
    with pytest.raises(BadRecords, match="not canonical"):
        decode_records(bytes(wide))
    beyond = bytearray(data)
    struct.pack_into("<H", beyond, HEADER_SIZE_V2, vocab + 1)
    with pytest.raises(BadRecords, match="outside the vocabulary"):
        decode_records(bytes(beyond))
    with pytest.raises(BadRecords, match="not UTF-8"):
        make_tokenizer_records([b"\xff"], 8, tokenizer_json=tok, tokenizer_id=tok_id, eos_id=1)
    # GPT2Config's default EOS with a small tokenizer: the message says where it came from.
    with pytest.raises(BadRecords, match=r"eos_token_id 50256 \(config\.json"):
        make_tokenizer_records([b"a"], 8, tokenizer_json=tok, tokenizer_id=tok_id, eos_id=50256)
