"""Base models: any Hugging Face causal-LM directory, and the built-in tiny Llamas.

A base model on disk (and in the store, as a collection blob) is the HF layout:
``config.json``, the weights as ``model.safetensors`` or as shards listed in
``model.safetensors.index.json``, and (to tokenise records with) ``tokenizer.json``;
other files (generation config, tokenizer config, README) may be present and are not
read. ``load_base_model`` builds any architecture transformers builds a causal LM for,
from transformers' own code only, and loads every tensor strictly; whether it can
*train* is the op audit's call (its kernel set lists the ops of the audited
architectures; anything else is refused at the first unaudited op).

The built-in tiny Llamas (``make_tiny_llama``) are made locally from a fixed config and
seed (no hub access), as ``config.json`` + ``model.safetensors``. Both files are
canonical so that the same model always gives the same collection ID:

1. ``config.json`` is ``json.dumps(config.to_dict(), sort_keys=True, indent=2)`` + newline.
2. ``model.safetensors`` holds every tensor of the state dict, contiguous, float32, with the
   single metadata key ``{"format": "pt"}`` (safetensors writes several metadata keys in a
   per-process order; one key is byte-stable, research/train.md section 4).

Seeded initialisation is not portable across CPU ISAs (research/train.md section 1): a
base model is made once and shipped as a blob; a verifier never re-derives it.

torch, transformers and safetensors' torch half are imported inside the functions that
use them: ``training.rounds.round`` imports this module for ``blob train check``, which
must run without the ``train`` extra, and those libraries take seconds to import.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.errors import BadModel, BadRecords
from training.records import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, Records

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

    from blobstore import Store

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_NAME = "tokenizer.json"
# A base model's config.json is a few KiB; anything this large is not one.
MAX_CONFIG_SIZE = 1 << 20
# An index maps every tensor name to a shard: ~100 bytes each, a few thousand tensors.
MAX_INDEX_SIZE = 16 << 20
_SHARD_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}\.safetensors")


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    max_positions: int


# "tiny" is research/train.md's size s (~0.12M parameters); "small" is its size l
# (~3.7M parameters) with the 260-token byte vocabulary and a wider MLP to keep the count.
SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        hidden=64, intermediate=172, layers=2, heads=4, kv_heads=2, max_positions=512
    ),
    "small": ModelSize(
        hidden=256, intermediate=816, layers=4, heads=8, kv_heads=8, max_positions=512
    ),
}


def llama_config_dict(size: str = "tiny") -> dict[str, Any]:
    """The keyword arguments of the ``LlamaConfig`` for ``size``."""
    try:
        s = SIZES[size]
    except KeyError:
        raise BadModel(f"unknown model size {size!r}; choose one of {sorted(SIZES)}") from None
    return {
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": s.max_positions,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
        "use_cache": False,
    }


def make_tiny_llama(size: str = "tiny", seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised float32 ``LlamaForCausalLM`` of ``size``, on the CPU, eval mode.

    Eager attention: it is the most auditable path, and the same on every device.
    """
    # heavy: see the module doc
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**llama_config_dict(size))
    config._attn_implementation = "eager"
    # fork_rng leaves the caller's global RNG as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def canonical_config_json(config_dict: dict[str, Any]) -> bytes:
    return (json.dumps(config_dict, sort_keys=True, indent=2) + "\n").encode()


def save_base_model(model: LlamaForCausalLM, directory: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` (both canonical) into ``directory``."""
    from safetensors.torch import save_file  # heavy (torch): see the module doc

    directory.mkdir(parents=True, exist_ok=True)
    config_dict = model.config.to_dict()
    (directory / CONFIG_NAME).write_bytes(canonical_config_json(config_dict))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def causal_lm_types() -> frozenset[str]:
    """The ``model_type`` values transformers builds a causal LM for."""
    # heavy: see the module doc
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a base model directory, bounded and checked to be a causal LM
    that transformers builds from its own code (never a repository's ``auto_map`` code)."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise BadModel(f"a base model collection needs {CONFIG_NAME}")
    if path.stat().st_size > MAX_CONFIG_SIZE:
        raise BadModel(f"{CONFIG_NAME} is larger than {MAX_CONFIG_SIZE} bytes")
    try:
        config = json.loads(path.read_bytes())
    except ValueError as exc:
        raise BadModel(f"{CONFIG_NAME} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BadModel(f"{CONFIG_NAME} is not a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in causal_lm_types():
        raise BadModel(
            f"{CONFIG_NAME} model_type {model_type!r} is not a causal LM that transformers "
            "builds (e.g. llama, gpt2, qwen2, mistral)"
        )
    if "auto_map" in config:
        raise BadModel(f"{CONFIG_NAME} asks for repository code (auto_map); it is never run")
    return config


def weight_files(directory: Path) -> dict[str, list[str]]:
    """Safetensors file -> the tensor names it must hold: ``model.safetensors``, or the
    shards that ``model.safetensors.index.json`` maps (pickled ``.bin`` weights are never
    loaded: unpickling runs code)."""
    index = directory / INDEX_NAME
    if index.is_file():
        if index.stat().st_size > MAX_INDEX_SIZE:
            raise BadModel(f"{INDEX_NAME} is larger than {MAX_INDEX_SIZE} bytes")
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise BadModel(f"{INDEX_NAME} has no weight_map: {exc}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadModel(f"{INDEX_NAME} weight_map is not a non-empty object")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            if not (isinstance(file, str) and _SHARD_RE.fullmatch(file)):
                raise BadModel(f"{INDEX_NAME} maps {name!r} to {file!r}, not a shard file")
            files.setdefault(file, []).append(name)
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise BadModel(f"{INDEX_NAME} names shard {missing[0]}, which the collection lacks")
        return files
    if (directory / WEIGHTS_NAME).is_file():
        return {WEIGHTS_NAME: []}
    raise BadModel(
        f"no safetensors weights: the collection needs {WEIGHTS_NAME} or {INDEX_NAME} "
        "with its shards (pickled .bin weights are never loaded)"
    )


def load_base_model(directory: Path) -> Any:
    """Load a Hugging Face causal-LM directory (CPU, float32, eager attention).

    The model is built from ``config.json`` by transformers' own classes and every
    tensor comes from the safetensors files: an unexpected tensor, or a missing one that
    is not a tied copy of a loaded one, is an error rather than a silently re-initialised
    weight.
    """
    # heavy: see the module doc
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.utils import logging as hf_logging

    config_dict = read_config(directory)
    files = weight_files(directory)
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # config notes on stderr are not ours to print
    try:
        config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    except (ValueError, TypeError, KeyError) as exc:
        raise BadModel(f"{CONFIG_NAME} is not a valid config: {exc}") from None
    config._attn_implementation = "eager"
    config.use_cache = False
    state: dict[str, Any] = {}
    for file, names in sorted(files.items()):
        try:
            tensors = load_file(str(directory / file))
        except Exception as exc:  # safetensors raises its own untyped errors
            raise BadModel(f"{file} is not readable safetensors: {exc}") from None
        if names and set(tensors) != set(names):
            raise BadModel(f"{file} does not hold the tensors {INDEX_NAME} maps to it")
        clash = set(tensors) & set(state)
        if clash:
            raise BadModel(f"tensor {sorted(clash)[0]} is in more than one shard")
        state.update(tensors)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation="eager", dtype=torch.float32
        )
    model.float()
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        raise BadModel(f"the weights do not match {CONFIG_NAME}: {exc}") from None
    tied = getattr(model, "_tied_weights_keys", None) or {}
    sources = tied if isinstance(tied, dict) else {}
    untied = [k for k in missing if not (k in sources and sources[k] in state)]
    if unexpected or untied:
        what = f"unexpected tensor {unexpected[0]}" if unexpected else f"no tensor {untied[0]}"
        raise BadModel(f"the weights do not match {CONFIG_NAME}: {what}")
    model.eval()
    return model


def base_tokenizer_id(store: Store, base_id: str) -> str | None:
    """The blob ID of the base collection's ``tokenizer.json`` (None: it has none)."""
    for entry in store.read_collection(base_id):
        if entry.path == TOKENIZER_NAME:
            return entry.blob_id
    return None


def check_records_fit(records: Records, tokenizer_id: str | None, vocab_size: int) -> None:
    """``BadRecords`` unless ``records`` were made for this base: by its tokenizer.json
    (or byte-level for a base whose vocabulary holds the 260 byte tokens)."""
    if records.tokenizer_id is None and tokenizer_id is not None:
        raise BadRecords(
            f"the records are byte-level, but the base model has its own {TOKENIZER_NAME} "
            f"({tokenizer_id}); make records with `blob train records --base BASE`"
        )
    if records.tokenizer_id is not None and records.tokenizer_id != tokenizer_id:
        theirs = tokenizer_id or f"none (the base has no {TOKENIZER_NAME})"
        raise BadRecords(
            f"the records were tokenised with tokenizer {records.tokenizer_id}, but the "
            f"base model's {TOKENIZER_NAME} is {theirs}; make records with "
            "`blob train records --base BASE`"
        )
    if records.vocab_size > vocab_size:
        raise BadRecords(
            f"the records use a vocabulary of {records.vocab_size} tokens, larger than the "
            f"base model's {vocab_size}; make records with `blob train records --base BASE`"
        )
