"""The deterministic LoRA training loop (torch + peft), shared by rounds, replay, the
kernel-set builder and the benchmark. Imports torch and peft: only the train commands
import this module.

Order of a round, each part a pure function of its inputs within one kernel class:

1. ``prepare``: ``seed_all(seed)`` right before ``get_peft_model`` (LoRA A is initialised
   from the global RNG), then the model moves to the device in train mode and AdamW
   (single-tensor; ``capturable`` on CUDA so its step counter is on the device) is made
   over the trainable parameters in module order.
2. ``batch_order``: the records each step reads, from BLAKE3 of (seed, epoch, index), so
   the order never depends on a torch RNG kernel.
3. ``run_steps``: per step, the batch is built outside the audit; forward (HF causal-LM
   loss; padding is ignored), backward, ``optimizer.step``, ``zero_grad`` and the loss
   read-back run inside the auditor, whose dispatcher-regime kernels stay installed for
   the whole run (training.rounds.audit, point 5); before step 0 the model's tensors are
   checked to be on the device (``check_placement``, point 3). Each loss is logged as
   its float32 bits.
4. ``state_root``: BLAKE3 over canonical tensor bytes of the adapter parameters and the
   optimizer state (never over a file).
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.pytorch_utils import Conv1D

from training.determinism import seed_all
from training.errors import AuditViolation, BadRecipe, BadRecords
from training.records import PAD_ID, Records, decode_records
from training.rounds.recipe import Recipe

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Labels the HF loss ignores (padding).
IGNORE_INDEX = -100


@dataclass
class Session:
    model: PeftModel
    optimizer: torch.optim.AdamW
    device: str
    recipe: Recipe
    seed: int
    params: list[tuple[str, torch.nn.Parameter]]


def decode(data: bytes) -> Records:
    return decode_records(data)


def check_targets(base: torch.nn.Module, targets: tuple[str, ...]) -> bool:
    """Refuse target modules the base does not have (peft would fail with a long traceback
    only after loading); returns whether the targets are GPT-2 ``Conv1D`` layers (weights
    stored transposed: peft's ``fan_in_fan_out``). Matching is peft's: a module name equal
    to the target or ending in ``.<target>``."""
    found: dict[str, set[str]] = {t: set() for t in targets}
    trainable: set[str] = set()
    for name, module in base.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear | Conv1D):
            trainable.add(leaf)
        if leaf in found:
            found[leaf].add(kind)
    layers = ", ".join(sorted(trainable)) or "none"
    for target, kinds in found.items():
        if not kinds:
            raise BadRecipe(
                f"recipe target module {target!r} is not in the base model; "
                f"its linear layers are: {layers}"
            )
        if not kinds <= {"Linear", "Conv1D"}:
            raise BadRecipe(
                f"recipe target module {target!r} is a {'/'.join(sorted(kinds))}, not a "
                f"linear layer; LoRA rounds train linear layers: {layers}"
            )
    kinds = set().union(*found.values())
    if kinds == {"Linear", "Conv1D"}:
        raise BadRecipe("recipe targets mix Linear and GPT-2 Conv1D layers; pick one kind")
    return kinds == {"Conv1D"}


def prepare(base: torch.nn.Module, recipe: Recipe, seed: int, device: str) -> Session:
    """Wrap ``base`` with a fresh LoRA adapter (from ``seed``) and make the optimizer."""
    fan_in_fan_out = check_targets(base, recipe.target_modules)
    config = LoraConfig(
        fan_in_fan_out=fan_in_fan_out,
        r=recipe.rank,
        lora_alpha=recipe.alpha,
        lora_dropout=recipe.dropout,
        target_modules=list(recipe.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    seed_all(seed)
    with warnings.catch_warnings():
        # peft 0.21 probes a transformers 5 attribute that warns it is deprecated.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        model = get_peft_model(base, config)
    model.to(device)
    model.train()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [p for _, p in params],
        lr=recipe.lr,
        betas=(recipe.beta1, recipe.beta2),
        eps=recipe.eps,
        weight_decay=recipe.weight_decay,
        foreach=False,
        fused=False,
        capturable=device == "cuda",
    )
    # Dropout draws from the device's generator from here on.
    seed_all(seed)
    return Session(model, optimizer, device, recipe, seed, params)


def batch_order(count: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Record indices of each step: epochs of BLAKE3-keyed permutations, concatenated."""
    needed = batch_size * steps
    flat: list[int] = []
    epoch = 0
    while len(flat) < needed:
        prefix = struct.pack("<QQ", seed & (2**64 - 1), epoch)
        flat.extend(
            sorted(
                range(count),
                key=lambda i: blake3.blake3(prefix + struct.pack("<Q", i)).digest(),
            )
        )
        epoch += 1
    return [flat[s * batch_size : (s + 1) * batch_size] for s in range(steps)]


def loss_bits(value: float) -> int:
    """The float32 bits of a loss (a float32 read back as a Python float is exact)."""
    bits: int = struct.unpack("<I", struct.pack("<f", value))[0]
    return bits


def batches(session: Session, records: Records) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's (input ids, labels) on the device; padding is ignored by the loss."""
    recipe = session.recipe
    if records.seq_len != recipe.seq_len:
        raise BadRecords(
            f"records have seq_len {records.seq_len} but the recipe says {recipe.seq_len}; "
            "make records with the recipe's --seq-len"
        )
    for indices in batch_order(records.count, recipe.batch_size, recipe.steps, session.seed):
        ids = torch.from_numpy(np.ascontiguousarray(records.tokens[indices]))
        padding = ids == records.pad_id
        labels = ids.masked_fill(padding, IGNORE_INDEX)
        if records.pad_id != PAD_ID:
            # Tokenizer records pad with an id past the vocabulary: the model reads id 0
            # there (causal attention never looks ahead to it; the loss ignores it).
            ids = ids.masked_fill(padding, 0)
        yield ids.to(session.device), labels.to(session.device)


def check_placement(model: Any, device: str) -> None:
    """Refuse a model that holds a parameter or buffer off ``device``, or any tensor
    attribute on meta (training.rounds.audit, point 3: a CPU kernel reads a meta tensor
    without complaint). Another tensor attribute may be elsewhere: one that computes is
    seen by its op."""
    for module_name, module in model.named_modules():
        tensors = [
            *((n, t, True) for n, t in module.named_parameters(recurse=False)),
            *((n, t, True) for n, t in module.named_buffers(recurse=False)),
            *((n, t, False) for n, t in vars(module).items() if isinstance(t, torch.Tensor)),
        ]
        for name, tensor, registered in tensors:
            where = tensor.device.type
            if where == "meta" or (registered and where != device):
                raise AuditViolation(
                    f"round refused: model tensor {module_name or 'model'}.{name} is on "
                    f"{where}, not on the round's device {device}"
                )


def run_steps(
    session: Session,
    records: Records,
    *,
    auditor: Any = None,
    on_step: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Train ``recipe.steps`` steps; returns each step's loss bits. ``auditor`` (an
    ``OpAuditor``) wraps forward, backward, the optimizer step and the loss read-back of
    every step, and is installed (its dispatcher-regime kernels) for the whole run."""
    if auditor is None:
        return _run_steps(session, records, None, on_step)
    check_placement(session.model, session.device)
    with auditor.installed():
        return _run_steps(session, records, auditor, on_step)


def _run_steps(
    session: Session,
    records: Records,
    auditor: Any,
    on_step: Callable[[int, int], None] | None,
) -> list[int]:
    log: list[int] = []
    model, optimizer = session.model, session.optimizer
    for step, (ids, labels) in enumerate(batches(session, records)):
        try:
            if auditor is not None:
                with auditor:
                    value = train_step(model, optimizer, ids, labels)
            else:
                value = train_step(model, optimizer, ids, labels)
        except RuntimeError as exc:
            # use_deterministic_algorithms(True) raises for an op without a deterministic
            # implementation on this device: that refuses the round, like the audit does.
            if "deterministic" not in str(exc):
                raise
            reason = str(exc).splitlines()[0]
            raise AuditViolation(f"round refused at step {step}: {reason}") from exc
        bits = loss_bits(value)
        log.append(bits)
        if on_step is not None:
            on_step(step, bits)
    return log


def train_step(
    model: PeftModel, optimizer: torch.optim.Optimizer, ids: torch.Tensor, labels: torch.Tensor
) -> float:
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach().item())


def named_state(session: Session) -> dict[str, torch.Tensor]:
    """Adapter parameters and optimizer state by name (``{param}::exp_avg`` etc.)."""
    named: dict[str, torch.Tensor] = {n: p.detach() for n, p in session.params}
    state = session.optimizer.state
    for name, param in session.params:
        for key, value in state.get(param, {}).items():
            if isinstance(value, torch.Tensor):
                named[f"{name}::{key}"] = value.detach()
    return named


def hash_tensors(named: dict[str, torch.Tensor]) -> bytes:
    """BLAKE3 over canonical tensor bytes: sorted names, each with its dtype, shape and raw
    little-endian bytes, every field length-prefixed (research/train.md section 4)."""
    h = blake3.blake3(b"TENSORSET/v1")
    h.update(struct.pack("<Q", len(named)))
    for key in sorted(named):
        t = named[key].detach().to("cpu").contiguous()
        kb = key.encode()
        ds = str(t.dtype).encode()
        h.update(struct.pack("<Q", len(kb)) + kb + struct.pack("<Q", len(ds)) + ds)
        h.update(struct.pack("<Q", t.dim()) + b"".join(struct.pack("<Q", d) for d in t.shape))
        raw = (t if t.dim() else t.reshape(1)).view(torch.uint8).numpy().tobytes()
        h.update(struct.pack("<Q", len(raw)))
        h.update(raw)
    return h.digest()


def state_root(session: Session) -> bytes:
    return hash_tensors(named_state(session))


def save_adapter(session: Session, directory: Path) -> None:
    """Write a peft-loadable adapter: ``adapter_model.safetensors`` (single metadata key,
    byte-stable) and ``adapter_config.json`` rewritten canonically (peft writes
    ``target_modules`` in set order, which varies per process)."""
    directory.mkdir(parents=True, exist_ok=True)
    session.model.save_pretrained(str(directory), safe_serialization=True)
    for extra in directory.iterdir():
        if extra.name not in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            extra.unlink()
    config_path = directory / ADAPTER_CONFIG
    config = json.loads(config_path.read_bytes())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_bytes((json.dumps(config, sort_keys=True, indent=2) + "\n").encode())
