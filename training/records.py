"""Tokenised training records: the byte-level tokenizer and the canonical records blob.

Tokenizer ("bytes-v1"): every byte ``b`` of a file becomes token ``b + BYTE_OFFSET``; the
ids below ``BYTE_OFFSET`` are special: ``PAD_ID`` (0) fills the tail of the last record,
``BOS_ID`` (1) opens each file and ``EOS_ID`` (2) closes it; id 3 is reserved. The
vocabulary is therefore ``VOCAB_SIZE = 256 + BYTE_OFFSET = 260`` tokens, and no text
normalisation happens: decoding is exact for every byte string.

Records: the files, each as ``BOS bytes... EOS``, are concatenated in the order given into
one token stream that is cut into records of exactly ``seq_len`` tokens; the last record is
padded with ``PAD_ID`` (the loss ignores padding), except that a lone last token (the
final EOS, which has nothing to predict) is dropped rather than padded. The blob is

    offset size  field
    0      8     magic b"BNRECv1\\n"
    8      1     token width in bytes: 2 (uint16) or 4 (uint32), the smallest that fits
    9      1     tokenizer id: 1 = bytes-v1
    10     2     reserved, zero
    12     4     vocab size (uint32 LE)
    16     4     seq_len (uint32 LE)
    20     4     record count (uint32 LE)
    24     ...   count * seq_len tokens, little-endian, record after record

and nothing else. Encoding is a pure function of (files' bytes, seq_len); decoding rejects
any blob that encoding could not have produced (bad magic, width, sizes, token ids).

Records of a Hugging Face base model (``BNRECv2``): the files, each decoded as UTF-8 text,
are tokenised with the base collection's own ``tokenizer.json`` (the ``tokenizers``
library, with its post-processor: a Llama-style tokenizer adds its BOS) and followed by
the model config's EOS id when it has one. Padding is the id ``vocab`` (one past the
tokenizer's last id, so it can never be a real token: the trainer feeds it as id 0 and
the loss ignores it). The header adds the tokenizer's blob ID, so records say which
tokenizer made them and a round refuses records made for another base::

    0      8     magic b"BNRECv2\n"
    8      1     token width: 2 or 4, the smallest that holds ``vocab`` (the padding id)
    9      1     tokenizer id: 2 = tokenizer.json
    10     2     reserved, zero
    12     4     vocab: the tokenizer's size with added tokens
    16     4     seq_len
    20     4     record count
    24     32    BLAKE3 blob ID of the tokenizer.json, raw
    56     ...   count * seq_len tokens, little-endian

``tokenizers`` is imported inside the one function that uses it: the byte-level records
and the decoder serve commands that run without the ``train`` extra, and it is slow to
import.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from training.errors import BadRecords

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 4
VOCAB_SIZE = 256 + BYTE_OFFSET
TOKENIZER_BYTES_V1 = 1

TOKENIZER_JSON = 2

MAGIC = b"BNRECv1\n"
MAGIC_V2 = b"BNRECv2\n"
_HEADER = struct.Struct("<8sBBHIII")
_HEADER_V2 = struct.Struct("<8sBBHIII32s")
HEADER_SIZE = _HEADER.size
HEADER_SIZE_V2 = _HEADER_V2.size
# A tokenizer.json of a real model is 2-20 MB; beyond this it is not one.
MAX_TOKENIZER_SIZE = 64 << 20
# Above this a vocabulary does not fit the 4-byte token width with room for the pad id.
MAX_VOCAB = 1 << 31

# A record is one training sequence; the models here have max_position_embeddings 512 and
# nobody trains a LoRA round on sequences longer than this, so a larger value is corrupt.
MAX_SEQ_LEN = 8192
# Bounds what a records blob may make us allocate (1 GiB of tokens).
MAX_TOKENS = 1 << 29


def encode_bytes(data: bytes) -> list[int]:
    """One file's tokens: ``BOS``, each byte plus ``BYTE_OFFSET``, ``EOS``."""
    return [BOS_ID, *(b + BYTE_OFFSET for b in data), EOS_ID]


def decode_tokens(tokens: Sequence[int]) -> bytes:
    """The bytes that ``tokens`` spell; special tokens are dropped."""
    return bytes(t - BYTE_OFFSET for t in tokens if BYTE_OFFSET <= t < VOCAB_SIZE)


@dataclass(frozen=True)
class Records:
    """Decoded records: ``tokens`` has shape (count, seq_len), dtype int64.

    ``pad_id`` is the padding token (``PAD_ID`` for bytes-v1, ``vocab_size`` for
    tokenizer records); ``tokenizer_id`` is the tokenizer.json blob ID (None: bytes-v1).
    """

    seq_len: int
    vocab_size: int
    tokens: npt.NDArray[np.int64]
    pad_id: int = PAD_ID
    tokenizer_id: str | None = None

    @property
    def count(self) -> int:
        return int(self.tokens.shape[0])


def make_records(files: Sequence[bytes], seq_len: int) -> bytes:
    """The canonical records blob for ``files`` (each file's bytes), cut at ``seq_len``."""
    if not 2 <= seq_len <= MAX_SEQ_LEN:
        raise BadRecords(f"seq_len {seq_len} is outside 2..{MAX_SEQ_LEN}")
    if not files:
        raise BadRecords("no input files: give at least one file to tokenise")
    stream: list[int] = []
    for data in files:
        stream.extend(encode_bytes(data))
    if len(stream) % seq_len == 1:
        # A lone last token (always the final EOS) predicts nothing: no record for it.
        stream.pop()
    count = -(-len(stream) // seq_len)
    if count * seq_len > MAX_TOKENS:
        raise BadRecords(f"{len(stream)} tokens exceed the limit of {MAX_TOKENS}")
    stream.extend([PAD_ID] * (count * seq_len - len(stream)))
    width = 2 if VOCAB_SIZE <= 1 << 16 else 4
    array = np.asarray(stream, dtype="<u2" if width == 2 else "<u4")
    header = _HEADER.pack(MAGIC, width, TOKENIZER_BYTES_V1, 0, VOCAB_SIZE, seq_len, count)
    return header + array.tobytes()


def _width(top: int) -> int:
    return 2 if top < 1 << 16 else 4


def make_tokenizer_records(
    files: Sequence[bytes],
    seq_len: int,
    *,
    tokenizer_json: bytes,
    tokenizer_id: str,
    eos_id: int | None,
) -> bytes:
    """The canonical ``BNRECv2`` records of ``files`` tokenised by ``tokenizer_json``."""
    from tokenizers import Tokenizer  # heavy: see the module doc

    if not 2 <= seq_len <= MAX_SEQ_LEN:
        raise BadRecords(f"seq_len {seq_len} is outside 2..{MAX_SEQ_LEN}")
    if not files:
        raise BadRecords("no input files: give at least one file to tokenise")
    if len(tokenizer_json) > MAX_TOKENIZER_SIZE:
        raise BadRecords(f"tokenizer.json is larger than {MAX_TOKENIZER_SIZE} bytes")
    try:
        tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as exc:  # tokenizers raises its own untyped errors
        raise BadRecords(f"tokenizer.json is not a tokenizers file: {exc}") from None
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if not 1 <= vocab < MAX_VOCAB:
        raise BadRecords(f"tokenizer vocabulary {vocab} is out of bounds (1..{MAX_VOCAB - 1})")
    if eos_id is not None and not 0 <= eos_id < vocab:
        raise BadRecords(
            f"the model's eos_token_id {eos_id} (config.json; GPT2Config's default is 50256) "
            f"is outside the tokenizer's vocabulary of {vocab}: set eos_token_id in "
            "config.json to the tokenizer's end-of-text token"
        )
    stream: list[int] = []
    for index, data in enumerate(files):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRecords(f"input {index + 1} is not UTF-8 text ({exc.reason})") from None
        stream.extend(tokenizer.encode(text).ids)
        if eos_id is not None:
            stream.append(eos_id)
    if len(stream) % seq_len == 1:
        stream.pop()  # a lone last token predicts nothing
    count = -(-len(stream) // seq_len)
    if count < 1 or count * seq_len > MAX_TOKENS:
        raise BadRecords(f"{len(stream)} tokens: no record, or more than {MAX_TOKENS}")
    stream.extend([vocab] * (count * seq_len - len(stream)))
    width = _width(vocab)
    array = np.asarray(stream, dtype="<u2" if width == 2 else "<u4")
    raw_id = bytes.fromhex(tokenizer_id)
    header = _HEADER_V2.pack(MAGIC_V2, width, TOKENIZER_JSON, 0, vocab, seq_len, count, raw_id)
    return header + array.tobytes()


def _decode_v2(data: bytes) -> Records:
    if len(data) < HEADER_SIZE_V2:
        raise BadRecords(f"records blob is {len(data)} bytes, shorter than its header")
    _magic, width, tokenizer, reserved, vocab, seq_len, count, raw_id = _HEADER_V2.unpack_from(data)
    if tokenizer != TOKENIZER_JSON or not 1 <= vocab < MAX_VOCAB:
        raise BadRecords(f"unknown tokenizer {tokenizer} with vocab {vocab}")
    if width != _width(vocab) or reserved != 0:
        raise BadRecords(f"token width {width} / reserved {reserved} is not canonical")
    # The padding id is ``vocab`` itself: one past the vocabulary's last token.
    tokens = _token_matrix(data, HEADER_SIZE_V2, width, seq_len, count, vocab, max_id=vocab)
    return Records(seq_len, vocab, tokens, pad_id=vocab, tokenizer_id=raw_id.hex())


def _token_matrix(
    data: bytes, offset: int, width: int, seq_len: int, count: int, vocab: int, *, max_id: int
) -> np.ndarray:
    """The ``count x seq_len`` tokens after the header, each checked to be <= ``max_id``."""
    if not 2 <= seq_len <= MAX_SEQ_LEN or count < 1 or count * seq_len > MAX_TOKENS:
        raise BadRecords(f"records shape {count} x {seq_len} is out of bounds")
    if len(data) != offset + count * seq_len * width:
        raise BadRecords(
            f"records blob is {len(data)} bytes; header says {count} x {seq_len} tokens"
        )
    raw = np.frombuffer(data, dtype="<u2" if width == 2 else "<u4", offset=offset)
    if raw.size and int(raw.max()) > max_id:
        raise BadRecords(f"token id {int(raw.max())} is outside the vocabulary of {vocab}")
    return raw.astype(np.int64).reshape(count, seq_len)


def decode_records(data: bytes) -> Records:
    """Parse and validate a records blob; raises ``BadRecords`` saying what is wrong."""
    if data[:8] == MAGIC_V2:
        return _decode_v2(data)
    if len(data) < HEADER_SIZE:
        raise BadRecords(f"records blob is {len(data)} bytes, shorter than its header")
    magic, width, tokenizer, reserved, vocab, seq_len, count = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadRecords("not a records blob (bad magic); make one with `blob train records`")
    if tokenizer != TOKENIZER_BYTES_V1 or vocab != VOCAB_SIZE:
        raise BadRecords(f"unknown tokenizer {tokenizer} with vocab {vocab}")
    expected_width = 2 if vocab <= 1 << 16 else 4
    if width != expected_width or reserved != 0:
        raise BadRecords(f"token width {width} / reserved {reserved} is not canonical")
    # Bytes-v1's padding id is inside its vocabulary (PAD_ID).
    tokens = _token_matrix(data, HEADER_SIZE, width, seq_len, count, vocab, max_id=vocab - 1)
    return Records(seq_len=seq_len, vocab_size=vocab, tokens=tokens)
