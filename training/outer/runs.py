"""Making a run from the user's model (``blob outer init``), writing a round's state back
as a model directory (``blob outer export``), and what a worker builds from a spec.

1. ``init`` reads the model's whole state (``training.outer.module_state``: trainable
   parameters, floating buffers, fixed tensors, tied names) from a module, a Hugging Face
   directory (built by transformers' own classes from ``config.json``, every tensor from
   its safetensors files, sharded or not: ``training.model.load_base_model``) or a state
   file. It stores the initial state blob, the fixed tensors, the directory as a
   collection (the spec's ``base``) and the signed spec (``training.outer.spec``), each
   tagged with the run (``outer-<run>-spec``, ``-start``, ``-fixed``, ``-base``, and the
   records as ``-data``), so ``blob gc`` keeps what the spec names. A run ID the store
   already has is refused unless the caller says to replace it.
2. ``export`` takes a run by its spec ID, a tag naming it or its run ID, and writes the
   state of a round this store holds (default: the newest tagged
   ``outer-<run>-state-<round>``) as ``model.safetensors``, the whole ``state_dict()``
   (buffers, fixed tensors in their dtype, each tied name a copy), beside the base's
   config and tokenizer: ``load_state_dict(strict=True)`` or ``from_pretrained`` loads it.
   The directory appears whole or not at all (written beside it, synced, then renamed
   into place).
3. A worker given a spec builds its trainer (``training.outer.trainer.Trainer``) from the
   base collection and a records blob, on the device and thread count it is told; the
   kernel class that names comes from ``training.kernel_class``, never a silent fallback.
   A spec that names a step of the user's own (``RunSpec.step``) is refused here: only
   the Python API, given that step, can train and replay it (``training.outer.api``).
4. **Retention** (:class:`Retention`): a worker's store keeps what ``blob outer verify``
   needs for the whole run (closures, milestones, verdicts, the updates they name, the
   commitments, the start and anchor states: all tagged or in a tagged collection) and,
   of the rest, only the recent: the state blobs of the last ``keep`` rounds, and its own
   inner-state blobs and, in overlapped rounds, the blobs of the states its rounds' steps
   started from (what a replayer of its update fetches) of the last ``keep`` rounds.
   Older ones are deleted at once, not left for ``blob gc``, so a worker's disk is flat
   over a long run. A blob is deleted only if no tag names it (:func:`drop_blob`): a state
   that is also the run's start or an anchor stays.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from blobstore.exitcodes import ExitCode
from training.errors import TrainingError
from training.outer.spec import BadSpec, RunSpec, SignedSpec, decode_spec
from training.outer.verification import Level

if TYPE_CHECKING:
    from blobstore import Store
    from training.outer.loop import OuterState
    from training.outer.module_state import WholeState
    from training.outer.params import RunParams
    from training.outer.trainer import Trainer

# Weight files a base directory's copy in an export leaves out: the state's weights replace
# them (an index naming shards that are not there would make from_pretrained fail).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class RunNotFound(TrainingError):
    """The user named a run, round or model this store does not hold."""

    exit_code = ExitCode.USAGE


class RunExists(TrainingError):
    """``init`` of a run ID this store already has a spec for (the user's choice to make)."""

    exit_code = ExitCode.USAGE


def load_initial(
    source: Path | Any, *, buffers: Sequence[str] = (), frozen: Sequence[str] = ()
) -> WholeState:
    """Point 1: the initial whole state (``training.outer.module_state``) of a module, a
    Hugging Face directory or a state file (``buffers`` and ``frozen``: patterns naming
    the roles of a state dict saved without blobnet's metadata)."""
    from training.outer.module_state import StateError, read_state_file, whole_state

    if not isinstance(source, Path):
        return whole_state(source)
    if source.is_dir():
        from training.model import load_base_model

        if buffers or frozen:
            raise RunNotFound("--buffer and --frozen are for a state dict file, not a directory")
        return whole_state(load_base_model(source))
    if not source.is_file():
        raise RunNotFound(f"{source}: no such model directory or safetensors file")
    try:
        return read_state_file(source, buffers=buffers, frozen=frozen)
    except StateError as exc:
        raise RunNotFound(str(exc)) from None


def init_run(
    store: Store,
    signer: Any,
    source: Path | Any,
    *,
    run_id: str,
    authorities: Sequence[str],
    options: dict[str, Any],
    buffers: Sequence[str] = (),
    frozen: Sequence[str] = (),
    replace: bool = False,
) -> tuple[str, RunSpec]:
    """Point 1: store the initial state, the fixed tensors, the base and the signed spec,
    each tagged with the run; (spec ID, spec). ``source``: a module (its whole state), a
    Hugging Face directory or a state file. A run ID this store already has a spec for is
    refused unless ``replace``."""
    from training.outer.loop import initial_state, state_root
    from training.outer.milestones import tag
    from training.outer.module_state import encode_fixed
    from training.outer.spec import encode_spec
    from training.outer.state_blob import encode_state

    held = store.tags().get(spec_tag(run_id))
    if held is not None and not replace:
        raise RunExists(
            f"this store already has run {run_id!r} (spec {held[:16]}); choose another run ID, "
            "or --replace to point the run ID at the new spec"
        )
    whole = load_initial(source, buffers=buffers, frozen=frozen)
    state = initial_state(whole.trainable, whole.buffers)
    initial = store.put_bytes(encode_state(state))
    fixed_blob = store.put_bytes(encode_fixed(whole.fixed)) if whole.fixed else ""
    base = store.put_dir(source) if isinstance(source, Path) and source.is_dir() else ""
    layout = whole.layout()
    spec = RunSpec(
        run=run_id,
        initial=initial,
        root=state_root(state),
        tensors=tuple(sorted(layout.trainable.items())),
        authorities=tuple(authorities),
        base=base,
        buffers=tuple(sorted(layout.buffers.items())),
        fixed=tuple((n, d, shape) for n, (d, shape) in sorted(layout.fixed.items())),
        fixed_blob=fixed_blob,
        aliases=tuple(sorted(layout.aliases.items())),
        **options,
    )
    spec_id = store.put_bytes(encode_spec(spec, signer))
    # The spec keeps what it names (blob gc leaves a run's makings while the run is kept).
    for name, blob in (
        ("start", initial),
        ("fixed", fixed_blob),
        ("base", base),
        ("data", spec.data),
    ):
        if blob:
            store.tag(tag(run_id, name), blob)
    store.tag(spec_tag(run_id), spec_id)
    return spec_id, spec


def keep_spec_blob(store: Store, spec: RunSpec, blob: str) -> None:
    """A joining worker's store keeps the spec it joined by (``blob``), tagged as ``init``
    tags it, so every command takes the run ID there too, and keeps the base and records
    the spec names where it holds them (the initial state is tagged when the worker
    starts from it, the fixed tensors when fetched). A tag already naming another spec of
    that run ID is left as it is."""
    from training.outer.milestones import tag

    tags = store.tags()
    if spec_tag(spec.run) not in tags:
        store.tag(spec_tag(spec.run), blob)
    for name, held in ((tag(spec.run, "base"), spec.base), (tag(spec.run, "data"), spec.data)):
        if held and name not in tags and store.has(held):
            store.tag(name, held)


def spec_tag(run_id: str) -> str:
    from training.outer.milestones import tag

    return tag(run_id, "spec")


def read_spec(store: Store, ref: str) -> tuple[str, SignedSpec]:
    """A spec this store holds, by blob ID, tag, or run ID (its ``outer-<run>-spec`` tag)."""
    from blobstore import StoreError

    tags = store.tags()
    blob = tags.get(ref) or tags.get(spec_tag(ref)) or ref
    try:
        data = store.path(blob).read_bytes()
    except (StoreError, OSError, ValueError):
        raise RunNotFound(f"no run spec {ref!r} in this store (a spec ID, tag or run ID)") from None
    try:
        return blob, decode_spec(data)
    except BadSpec as exc:
        raise RunNotFound(f"{ref}: {exc}") from None


def params_from_spec(spec: RunSpec, *, rounds: int | None = None) -> RunParams:
    """The worker's RunParams for ``spec``; ``rounds`` (a worker's --rounds) caps an
    open-ended run."""
    from training.outer.params import RunParams

    planned = spec.rounds if rounds is None else rounds
    if planned < 1:
        raise RunNotFound(f"run {spec.run} is open-ended: say how many rounds to take part in")
    return RunParams(
        run_id=spec.run,
        workers=spec.workers,
        rounds=planned,
        inner_steps=spec.inner_steps,
        deadline=spec.deadline,
        proposer_timeout=spec.proposer_timeout,
        seed=spec.seed,
        batch=spec.batch,
        inner_lr=spec.inner_lr,
        chunk=spec.chunk,
        k=spec.k,
        replay_rate=spec.replay_rate if spec.level == Level.REPLAYED else 0.0,
        outer_lr=spec.outer_lr,
        outer_momentum=spec.outer_momentum,
        feedback_decay=spec.ef_decay,
        quorum=spec.quorum,
        overlap=spec.overlap,
    )


def state_tags(store: Store, run_id: str) -> dict[int, str]:
    """Round -> state blob this store holds for the run (the worker's tags)."""
    from training.outer.milestones import tag

    prefix = tag(run_id, "state") + "-"
    out = {}
    for name, blob in store.tags().items():
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            out[int(name[len(prefix) :])] = blob
    return out


def export_run(store: Store, ref: str, dest: Path, *, round_: int | None = None) -> tuple[int, str]:
    """Point 2: write round ``round_``'s state (default: the newest held) to ``dest``;
    returns (round, state blob)."""
    from training.outer.state_blob import decode_state

    _, signed = read_spec(store, ref)
    spec = signed.spec
    held = state_tags(store, spec.run)
    held.setdefault(0, spec.initial)
    r = max(held) if round_ is None else round_
    if r not in held:
        raise RunNotFound(f"run {spec.run}: no state of round {r} here (held: {sorted(held)})")
    state = decode_state(
        store.path(held[r]).read_bytes(), expected=spec.shapes(), buffers=dict(spec.buffers)
    )
    fixed: dict[str, Any] = {}
    if spec.fixed_blob:
        from training.outer.module_state import decode_fixed

        if not store.has(spec.fixed_blob):
            raise RunNotFound(f"run {spec.run}: its fixed tensors {spec.fixed_blob} are not here")
        fixed = decode_fixed(store.path(spec.fixed_blob).read_bytes(), spec.layout().fixed)
    if dest.exists() and any(dest.iterdir()):
        raise RunNotFound(f"{dest} exists and is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        if spec.base:
            base = tmp / "base"
            store.export(spec.base, base)
            for path in sorted(base.rglob("*")):
                rel = path.relative_to(base)
                if path.is_dir() or path.name in _WEIGHT_INDEXES:
                    continue
                if path.suffix in _WEIGHT_SUFFIXES:
                    continue
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, tmp / rel)
            shutil.rmtree(base)
        _write_weights(tmp / "model.safetensors", state, fixed, dict(spec.aliases))
        for path in tmp.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if dest.exists():
            dest.rmdir()
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return r, held[r]


def _write_weights(
    path: Path, state: OuterState, fixed: dict[str, Any], aliases: dict[str, str]
) -> None:
    """The whole ``state_dict()`` (point 2): parameters and buffers as float32, fixed
    tensors in their own dtype, and each tied name as a copy of the tensor it names (a
    safetensors file holds no shared tensors; ``load_state_dict(strict=True)`` wants every
    name)."""
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {
        n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in state.params.items()
    }
    tensors.update({n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in state.buffers.items()})
    tensors.update(fixed)
    for alias, name in aliases.items():
        tensors[alias] = tensors[name].clone()
    # One metadata key: safetensors writes several in a per-process order (research/train.md).
    save_file({n: tensors[n].contiguous() for n in sorted(tensors)}, str(path), {"format": "pt"})


@dataclass(frozen=True)
class SpecTrainer:
    """Point 3: builds a worker's trainer for a spec's model on given records, device and
    threads (the worker calls it once, replay once per replayed update)."""

    spec: RunSpec
    base_dir: Path | None
    tokens: Any  # int64 (rows, seq_len)
    device: str = "cpu"
    threads: int = 1
    pad_id: int | None = None

    def __call__(self, params: RunParams, shard: int) -> Trainer:
        from training.outer.trainer import Trainer

        model = None
        if self.base_dir is not None:
            from training.model import load_base_model
            from training.outer.trainer import TORCH_RNG_LOCK

            # load_base_model's fork_rng restores torch's generator on the way out: in a
            # replay's thread that rewound the dropout draws of the training running
            # beside it (an honest round-1 update then failed its replay).
            with TORCH_RNG_LOCK:
                model = load_base_model(self.base_dir)
        return Trainer(
            params,
            shard,
            model=model,
            tokens=self.tokens,
            device=self.device,
            threads=self.threads,
            pad_id=self.pad_id,
        )


TrainerFactory = Callable[["RunParams", int], "Trainer"]


@dataclass(frozen=True)
class SpecWorker:
    spec: RunSpec
    params: RunParams
    shard: int
    level: Level
    make_trainer: SpecTrainer


def prepare_spec_worker(
    store_root: Path,
    key_path: Path,
    spec_ref: str,
    data_ref: str | None,
    *,
    device: str,
    threads: int,
    rounds: int | None,
    bootstrap: Sequence[str] = (),
) -> SpecWorker:
    """Point 3: fetch what a spec names (from ``bootstrap`` peers where this store lacks
    it), check the verification level this worker offers, and build its trainer factory.
    A worker whose records are the spec's offers ``replayed``; any other data, ``bounded``."""
    import blake3

    from blobstore import Store
    from identity import load_or_create_key
    from training.outer.spec import check_level
    from training.records import decode_records

    store = Store.open(store_root)
    wanted = [spec_ref] if _is_blob_id(spec_ref) and not store.has(spec_ref) else []
    if wanted and bootstrap:
        _fetch_all(store_root, wanted, bootstrap)
    _, signed = read_spec(store, spec_ref)
    spec = signed.spec
    if spec.step:
        raise RunNotFound(
            f"run {spec.run} trains with the inner step {spec.step!r}, the user's own code: "
            "take part through the Python API (training.outer.api.OuterLoop, inner_step=)"
        )
    data = data_ref or spec.data
    if not data:
        raise RunNotFound(f"run {spec.run} names no records: give --data RECORDS")
    data = store.tags().get(data, data)
    missing = [b for b in (spec.initial, spec.base, data) if b and not store.has(b)]
    if missing:
        if not bootstrap:
            raise RunNotFound(f"this store lacks {missing[0]} and no --bootstrap peer was given")
        _fetch_all(store_root, missing, bootstrap)
    level = Level.REPLAYED if spec.data and data == spec.data else Level.BOUNDED
    check_level(spec, level)
    records = decode_records(store.path(data).read_bytes())
    keep_spec_blob(store, spec, read_spec(store, spec_ref)[0])
    base_dir = None
    if spec.base:
        base_dir = worker_files(store_root) / f"base-{spec.base[:16]}"
        if not base_dir.exists():
            tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=base_dir.parent))
            try:
                store.export(spec.base, tmp / "dir")
                os.replace(tmp / "dir", base_dir)
            except OSError:
                if not base_dir.is_dir():  # not another worker of this store, done first
                    raise
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    params = params_from_spec(spec, rounds=rounds)
    peer = load_or_create_key(key_path).peer_id
    shard = int.from_bytes(blake3.blake3(peer.encode()).digest()[:4], "little") % (1 << 20)
    if base_dir is not None:
        from training.model import base_tokenizer_id, check_records_fit, read_config

        vocab = int(read_config(base_dir)["vocab_size"])
        check_records_fit(records, base_tokenizer_id(store, spec.base), vocab)
    factory = SpecTrainer(spec, base_dir, records.tokens, device, threads, records.pad_id)
    return SpecWorker(spec, params, shard, level, factory)


@dataclass
class Retention:
    """Point 4, sans-IO: which state and inner-state blobs have fallen out of the last
    ``keep`` rounds. The caller deletes what it is told with :func:`drop_blob`."""

    keep: int
    states: list[tuple[int, str, str]] = field(default_factory=list)  # round, tag, blob
    inners: list[tuple[int, str]] = field(default_factory=list)  # round, blob

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError("a worker keeps at least one round's state (the tip)")

    def state(self, round_: int, tag: str, blob: str) -> list[tuple[str, str]]:
        """Round ``round_``'s state is ``blob`` under ``tag``: the (tag to untag, blob) to
        drop; the tag is "" for a state ``tag`` named before (a branch left behind)."""
        replaced = [("", b) for _, t, b in self.states if t == tag and b != blob]
        self.states = [s for s in self.states if s[1] != tag] + [(round_, tag, blob)]
        return replaced + [(t, b) for _, t, b in self._old(self.states)]

    def inner(self, round_: int, blob: str) -> list[str]:
        """This worker's inner state before round ``round_`` (or the state its steps started
        from) is ``blob``: blobs to drop."""
        self.inners = [s for s in self.inners if s[1] != blob] + [(round_, blob)]
        return [b for _, b in self._old(self.inners)]

    def _old(self, held: list[Any]) -> list[Any]:
        newest = max(r for r, *_ in held)
        old = [x for x in held if x[0] <= newest - self.keep]
        held[:] = [x for x in held if x[0] > newest - self.keep]
        return old


def drop_blob(store: Store, blob: str) -> bool:
    """Point 4: delete ``blob`` unless a tag names it; True if it went."""
    from blobstore import StoreError

    if blob in set(store.tags().values()):
        return False
    try:
        store.rm(blob)
    except StoreError:  # gone already, or a writer holds it: gc's job then
        return False
    return True


def worker_files(store_root: Path) -> Path:
    """Where a worker keeps its own files (the base model it unpacks, its result): inside
    its store, so two workers whose stores share a directory never meet. The store is
    made first where it is new (a new store's directory holds nothing else)."""
    from blobstore import Store

    Store.open(store_root)
    path = store_root / "outer"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _is_blob_id(ref: str) -> bool:
    return len(ref) == 64 and all(c in "0123456789abcdef" for c in ref)


def _fetch_all(store_root: Path, blobs: Sequence[str], bootstrap: Sequence[str]) -> None:
    from p2p import BlockingNode

    with BlockingNode(store_root, listen=["/ip4/127.0.0.1/tcp/0"], dht=False) as node:
        for blob in blobs:
            node.fetch(blob, providers=list(bootstrap))
