"""Tiny HF Llama base models, built locally from a fixed config and seed (no hub access).

A base model on disk (and in the store, as a collection blob) is the HF layout
``config.json`` + ``model.safetensors``. Both files are canonical so that the same model
always gives the same collection ID:

1. ``config.json`` is ``json.dumps(config.to_dict(), sort_keys=True, indent=2)`` + newline.
2. ``model.safetensors`` holds every tensor of the state dict, contiguous, float32, with the
   single metadata key ``{"format": "pt"}`` (safetensors writes several metadata keys in a
   per-process order; one key is byte-stable, research/train.md section 4).

Seeded initialisation is not portable across CPU ISAs (research/train.md section 1): a
base model is made once and shipped as a blob; a verifier never re-derives it.

torch and transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.errors import BadModel
from training.records import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# A base model's config.json is a few hundred bytes; anything this large is not one.
MAX_CONFIG_SIZE = 1 << 20


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
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config_dict = model.config.to_dict()
    (directory / CONFIG_NAME).write_bytes(canonical_config_json(config_dict))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


def load_base_model(directory: Path) -> LlamaForCausalLM:
    """Load a base model written by ``save_base_model`` (CPU, float32, eager attention).

    The model is built from the config and every tensor is loaded strictly, so a missing or
    extra tensor is an error rather than a silently re-initialised weight.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config_path = directory / CONFIG_NAME
    weights_path = directory / WEIGHTS_NAME
    if not config_path.is_file() or not weights_path.is_file():
        raise BadModel(f"base model needs {CONFIG_NAME} and {WEIGHTS_NAME} in one collection")
    if config_path.stat().st_size > MAX_CONFIG_SIZE:
        raise BadModel(f"{CONFIG_NAME} is larger than {MAX_CONFIG_SIZE} bytes")
    try:
        config_dict = json.loads(config_path.read_bytes())
        if not isinstance(config_dict, dict) or config_dict.get("model_type") != "llama":
            raise BadModel("config.json is not a Llama config")
        config = LlamaConfig.from_dict(config_dict)
    except (ValueError, TypeError) as exc:
        raise BadModel(f"config.json is not a valid Llama config: {exc}") from None
    config._attn_implementation = "eager"
    config.use_cache = False
    try:
        state = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own untyped errors
        raise BadModel(f"model.safetensors is not readable: {exc}") from None
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise BadModel(f"model.safetensors does not match config.json: {exc}") from None
    model.eval()  # type: ignore[no-untyped-call]
    return model
