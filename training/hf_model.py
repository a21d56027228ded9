"""Hugging Face model directories built locally: a tokenizer trained on a corpus and a
causal LM built from a config with a fixed seed (nothing downloaded).

For tests, the kernel-set builder and ``blob train init-model --arch``: real layouts at
toy sizes. A directory holds exactly what a user's model directory holds:

- ``config.json``: ``config.to_dict()``, canonical (sorted keys, 2-space indent);
- ``model-0000i-of-0000n.safetensors`` shards, tensors in sorted-name order, each file
  up to ``shard_bytes`` (one larger tensor gets a shard of its own), one metadata key
  (``{"format": "pt"}``: safetensors writes several in a per-process order), tied copies
  left out as ``save_pretrained`` does; and ``model.safetensors.index.json`` (canonical);
- ``tokenizer.json``: a byte-level BPE trained by the ``tokenizers`` library on the
  corpus (GPT-2-style: ``<|endoftext|>`` is BOS and EOS; Llama-style: ``<s>`` is added
  in front of every text by the post-processor and ``</s>`` is EOS).

Every file is a pure function of (architecture, seed, corpus, sizes) on one machine, so
the same inputs give the same collection ID. Seeded initialisation is not portable
across CPU ISAs (research/train.md section 1): build once, ship the blob.

torch, transformers, tokenizers and safetensors' torch half are imported inside the
functions that build: the helpers here that read a directory's config serve commands
(``blob train records --base``, round checks) that must run without the ``train`` extra,
and those libraries take seconds to import.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.errors import BadModel
from training.model import CONFIG_NAME, INDEX_NAME, TOKENIZER_NAME, canonical_config_json

ARCHS = ("gpt2", "llama")
# LoRA targets of each architecture's attention (GPT-2's fused qkv is a Conv1D).
ARCH_TARGETS = {"gpt2": ("c_attn",), "llama": ("k_proj", "o_proj", "q_proj", "v_proj")}
DEFAULT_VOCAB = 384
DEFAULT_SHARD_BYTES = 128 << 10
# A corpus to train a toy tokenizer on; beyond this it is not a toy.
MAX_CORPUS_BYTES = 64 << 20


def _config(arch: str, vocab: int, special: dict[str, int], overrides: dict[str, Any]) -> Any:
    from transformers import GPT2Config, LlamaConfig  # heavy: see the module doc

    common = {"vocab_size": vocab, "bos_token_id": special["bos"], "use_cache": False}
    common["eos_token_id"] = special["eos"]
    if arch == "gpt2":
        fields = {"n_positions": 256, "n_embd": 64, "n_layer": 2, "n_head": 4}
        return GPT2Config(**{**common, **fields, **overrides})
    if arch == "llama":
        fields = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        }
        return LlamaConfig(**{**common, **fields, **overrides})
    raise BadModel(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def train_tokenizer(arch: str, texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``; returns it and the
    ids of its BOS and EOS tokens."""
    # heavy: see the module doc
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|endoftext|>"] if arch == "gpt2" else ["<s>", "</s>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    if arch == "llama":
        bos = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
    return tokenizer


def write_model_dir(
    model: Any, tokenizer: Any, directory: Path, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> None:
    """Write ``model`` and ``tokenizer`` as a sharded HF directory (module doc)."""
    from safetensors.torch import save_file  # heavy (torch): see the module doc

    directory.mkdir(parents=True, exist_ok=True)
    tied = getattr(model, "_tied_weights_keys", None) or {}
    skip = set(tied) if isinstance(tied, dict) and model.config.tie_word_embeddings else set()
    state = {
        k: v.detach().to("cpu").contiguous()
        for k, v in sorted(model.state_dict().items())
        if k not in skip
    }
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_bytes(canonical_config_json(index))
    (directory / CONFIG_NAME).write_bytes(canonical_config_json(model.config.to_dict()))
    (directory / TOKENIZER_NAME).write_text(tokenizer.to_str() + "\n")


def build_model_dir(
    arch: str,
    directory: Path,
    corpus: Sequence[str],
    *,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overrides: dict[str, Any] | None = None,
) -> None:
    """Train a tokenizer on ``corpus``, build ``arch`` at toy size from ``seed`` and write
    both to ``directory``; ``overrides`` are config fields (e.g. the activation)."""
    # heavy: see the module doc
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if arch not in ARCHS:
        raise BadModel(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if sum(len(t) for t in corpus) > MAX_CORPUS_BYTES:
        raise BadModel(f"the tokenizer corpus is larger than {MAX_CORPUS_BYTES} bytes")
    tokenizer = train_tokenizer(arch, corpus, vocab_size)
    eos = "<|endoftext|>" if arch == "gpt2" else "</s>"
    bos = "<|endoftext|>" if arch == "gpt2" else "<s>"
    special = {"bos": tokenizer.token_to_id(bos), "eos": tokenizer.token_to_id(eos)}
    config = _config(
        arch, tokenizer.get_vocab_size(with_added_tokens=True), special, overrides or {}
    )
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation="eager", dtype=torch.float32
        )
    write_model_dir(model, tokenizer, directory, shard_bytes)


def model_eos(config: dict[str, Any]) -> int | None:
    """The EOS id records end each text with: ``eos_token_id`` (the first of a list)."""
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        return None
    if isinstance(eos, bool) or not isinstance(eos, int) or eos < 0:
        raise BadModel(f"{CONFIG_NAME} eos_token_id {eos!r} is not a token id")
    return eos


def config_bytes_to_dict(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise BadModel(f"{CONFIG_NAME} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadModel(f"{CONFIG_NAME} is not a JSON object")
    return obj
