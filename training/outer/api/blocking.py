"""The blocking face of :mod:`training.outer.api`: :class:`OuterLoop`, for a plain
training script, and a worker that is a ``torch.distributed`` group (point 6)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blobstore.canonical import encode as encode_canonical
from training.outer.api.clock import RoundTiming
from training.outer.api.core import JOIN_WAIT, Core, load_spec, run_worker, wants_fetch
from training.outer.api.driven import InnerStep
from training.outer.api.handoff import HANDOFF_WAIT, OuterLoopError, describe
from training.outer.api.model import gathered_state, is_sharded, trainable
from training.outer.api.scoring import eval_data_of
from training.outer.spec import RunSpec
from training.outer.verification import Level

if TYPE_CHECKING:
    import torch


def share_spec(spec: RunSpec | None, group: Any) -> RunSpec:
    """Point 6: rank 0's spec, to every rank of the group (checked there like any spec)."""
    import torch.distributed as dist

    from training.outer.spec import decode_body

    box = [None if spec is None else msgpack_body(spec)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    assert isinstance(box[0], bytes)
    return decode_body(box[0])


def msgpack_body(spec: RunSpec) -> bytes:
    """The spec's canonical body, as ranks exchange it."""
    return encode_canonical(spec.body())


def records_of(store: Any, spec: RunSpec, data: str | None) -> tuple[str, Any]:
    """Point 7: (records blob ID, its int64 rows) of ``data`` (default: the spec's)."""
    from training.outer.runs import RunNotFound
    from training.records import decode_records

    ref = data or spec.data
    if not ref:
        raise RunNotFound(f"run {spec.run} names no records: give data=RECORDS")
    from blobstore import StoreError

    blob = store.tags().get(ref, ref)
    try:
        held = store.has(blob)
    except (StoreError, ValueError):  # not a blob ID
        held = False
    if not held:
        raise RunNotFound(f"this store lacks the records blob {ref}: fetch it first")
    return blob, decode_records(store.path(blob).read_bytes()).tokens


class OuterLoop:
    """The blocking face (module doc): a worker of the run ``spec`` around ``model``.

    ``node``: a started ``p2p.BlockingNode`` made with ``pubsub=True`` and the machine key
    ``key_path`` its certificate admits; ``spec``: the run spec's ID (fetched from the
    ``bootstrap`` peers where the store lacks it), or a tag or run ID naming one in the
    node's store; ``certificate``: the admission
    certificate file; ``rounds``: rounds to take part in (an open-ended run needs it);
    ``eval_fn`` and ``eval_data`` (an int64 row array or a records blob ID) offer the
    ``scored`` level; ``bootstrap``: peers of the run (multiaddrs) to fetch S_0 from and
    dial; ``result_path``: where the worker writes its result JSON.
    ``inner_optimizer``: the user's optimizer, never stepped or changed by the loop: its
    state goes into the worker's resume checkpoint each round (point 8).
    ``late``: join a run already under way (catch up from its tip, not S_0).
    ``resume``: take this worker's checkpoint back from its store (its residual, the inner
    optimizer's state) and join from the run's tip (point 8); a new worker without one.
    ``group``: the ``torch.distributed`` group this worker's replicas form (point 6); its
    ranks other than 0 pass ``node=None``.
    ``inner_step`` (an :class:`InnerStep`) and ``data`` (a records blob ID or tag; default
    the spec's): the library drives the inner steps and the worker offers ``replayed``
    (point 7); call :meth:`run` instead of ``join()`` and ``step()``.
    ``keep_states``: how many rounds' state blobs the worker's store keeps (older ones
    are deleted; ``training.outer.worker`` point 5).
    """

    def __init__(
        self,
        node: Any,
        *,
        spec: str,
        model: torch.nn.Module,
        certificate: str | Path,
        inner_optimizer: torch.optim.Optimizer | None = None,
        rounds: int | None = None,
        eval_fn: Callable[[Any, Any], Any] | None = None,
        eval_data: Any = None,
        bootstrap: Sequence[str] = (),
        result_path: str | Path | None = None,
        group: Any = None,
        late: bool = False,
        inner_step: InnerStep | None = None,
        data: str | None = None,
        keep_states: int | None = None,
        resume: bool = False,
    ) -> None:
        self._group = group
        self._rank = 0
        if group is not None:
            import torch.distributed as dist

            self._rank = dist.get_rank(group)
        if self._rank == 0 and (node is None or node.key_path is None):
            raise OuterLoopError("the node needs a machine key file (BlockingNode key_path)")
        store = node.store if self._rank == 0 else None
        if self._rank == 0 and wants_fetch(store, spec, bootstrap):
            node.fetch(spec, providers=list(bootstrap))  # a spec ID the store lacks
        spec_blob, run_spec = load_spec(store, spec) if self._rank == 0 else ("", None)
        if group is not None:
            run_spec = share_spec(run_spec, group)
        assert run_spec is not None
        evaluation = (
            eval_data_of(store, eval_data) if eval_fn is not None and self._rank == 0 else None
        )
        records = None
        if inner_step is not None:
            if group is not None:
                raise OuterLoopError("a loop the library drives (inner_step) is one process")
            records = records_of(store, run_spec, data)
        self._core = Core(
            spec=run_spec,
            spec_blob=spec_blob,
            model=model,
            rounds=rounds,
            eval_fn=eval_fn if self._rank == 0 else None,
            eval_data=evaluation,
            bootstrap=bootstrap,
            level=None if self._rank == 0 else "group",
            inner_step=inner_step,
            records=records,
            keep_states=keep_states,
            optimizer=inner_optimizer if self._rank == 0 else None,
        )
        if self._core.overlap and group is not None:
            raise OuterLoopError(
                f"run {run_spec.run} overlaps rounds; that is built for a loop in one process "
                "(yours, or one the library drives), not a group yet"
            )
        if resume and (inner_step is not None or group is not None):
            raise OuterLoopError(
                "resume=True is for a loop whose steps are yours, in one process; a loop the "
                "library drives resumes as `blob outer worker --resume` does"
            )
        self._resume = resume
        self._core.join = late
        self._sharded = any(is_sharded(p) for p in trainable(model).values())
        if self._sharded and (group is None or eval_fn is not None):
            raise OuterLoopError(
                "a sharded (FSDP) model needs group= (its ranks gather it) and is not scored"
            )
        self._node = node
        self._cert = Path(certificate)
        self._result_path = Path(result_path) if result_path is not None else None
        self._thread: threading.Thread | None = None

    @property
    def level(self) -> Level:
        return self._core.level

    @property
    def round(self) -> int:
        """The round the model's current state starts (its number of applied rounds)."""
        return self._core.round

    @property
    def finished(self) -> bool:
        return self._core.finished

    @property
    def result(self) -> dict[str, Any] | None:
        """The worker's result (rounds, roots, verdicts) once it finished."""
        return self._core.result

    @property
    def timings(self) -> list[RoundTiming]:
        """Per round this loop took part in (point 9, ``training.outer.api.clock``):
        ``compute``, the user's own seconds (outside ``step()``, ``skip()`` and
        ``restore()``) since the round before ended; ``waited``, every second spent inside
        them in that span, whatever the cause (blocking: mostly the round's closure;
        overlapped: the model copied, states added at step boundaries, and a wait where the
        state the update is taken against had not come); ``overlapped``, the seconds of the
        round before's communication that ran during these steps. Utilisation is
        compute / (compute + waited)."""
        return self._core.timings

    def __enter__(self) -> OuterLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, timeout: float = HANDOFF_WAIT) -> dict[str, Any]:
        """Point 7: take part in the run's rounds, the library driving the inner steps;
        returns the worker's result, with the final state in the model."""
        core = self._core
        if core.driven is None:
            raise OuterLoopError("this loop's inner steps are the user's: join() and step()")
        self._spawn()
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise OuterLoopError(f"run {core.spec.run} did not end within {timeout:.0f}s")
        with core.handoff.cond:
            error, final = core.handoff.error, core.handoff.state
        if error is not None:
            raise OuterLoopError(f"the outer-loop worker stopped: {error}")
        if final is not None:
            core.state, core.root = final
            core.model.load(final[0])
        core.finished = True
        assert core.result is not None
        return core.result

    def join(self, timeout: float = JOIN_WAIT) -> None:
        """Start the worker and copy the run's state into the model (S_0, or the tip)."""
        if self._core.driven is not None:
            raise OuterLoopError("the library drives this loop's inner steps: call run()")
        if self._rank != 0:
            self._sync()  # point 6: rank 0's adopted state, to every rank
            return
        self._start(timeout)
        if self._group is not None:
            self._sync()

    def _start(self, timeout: float) -> None:
        self._spawn()
        if not self._core.adopt(timeout):
            raise OuterLoopError(f"run {self._core.spec.run} ended before this worker joined")

    def _spawn(self) -> None:
        from identity import load_key_file, machine_signer

        key = load_key_file(self._node.key_path)
        signer = machine_signer(key, self._node.key_path)  # TPM-backed where bound
        self._core.author = key.peer_id
        if self._resume:
            self._core.resume_from(self._node.store)
        core, node, cert, out = self._core, self._node, self._cert, self._result_path

        def main() -> None:
            try:
                result = node.call(run_worker, core, node.node, signer, cert, out)
            except BaseException as exc:  # reported to the user's thread by the hand-off
                core.worker_done(None, describe(exc))
            else:
                core.worker_done(result, None)

        self._thread = threading.Thread(target=main, name="blobnet-outer", daemon=True)
        self._thread.start()

    def step(self, loss: float | None = None) -> bool:
        """After each inner step (``loss``: optional, recorded as the round's mean loss).
        At the H-th: send the update, wait for the round's closure and copy the new state
        into the model; True then. ``finished`` turns true after the worker's last round."""
        core = self._core
        core.enter()  # point 9: every second in here is the loop's
        try:
            return self._step(loss)
        finally:
            core.leave()

    def _step(self, loss: float | None) -> bool:
        core = self._core
        if core.driven is not None:
            raise OuterLoopError("the library drives this loop's inner steps: call run()")
        if self._rank != 0:
            core.steps += 1
            if core.steps < core.params.inner_steps:
                return False
            core.steps = 0
            if self._sharded:
                gathered_state(core.model.module)  # point 6: rank 0 gathers the whole model
            self._sync()
            return True
        core.poll()  # point 9: a state that came while the steps ran
        if core.finished:
            return True
        if not core.count(loss):
            return False
        if core.overlap:
            if core.in_flight:
                core.wait_base()  # point 9: at most one round ahead
                if core.finished:
                    return True
            core.launch(self._node.store)  # point 9: the round's end behind the steps
            return True
        core.send(gathered_state(core.model.module) if self._sharded else None)
        if self._group is None:
            core.keep(self._node.store)  # point 8, while the round is agreed
        self._take_round()
        return True

    def skip(self) -> bool:
        """Send nothing this round (say the steps went wrong): wait for the round's result,
        the others' updates applied, and copy it into the model; True then, as ``step()``
        at the H-th. The error-feedback residual is left as it was."""
        core = self._core
        if core.driven is not None or self._group is not None:
            raise OuterLoopError("skip() is for a loop whose steps are yours, in one process")
        core.enter()
        try:
            if core.in_flight:
                core.wait_base()
            core.skip()
            self._take_round()
        finally:
            core.leave()
        return True

    def restore(self) -> None:
        """Copy the round's start state back into the model (parameters, buffers and the
        run's fixed buffers) and count this round's steps from 0 again: a round whose
        steps went wrong starts over."""
        core = self._core
        if core.driven is not None or self._group is not None:
            raise OuterLoopError("restore() is for a loop whose steps are yours, in one process")
        core.enter()
        try:
            if core.in_flight:
                core.wait_base()  # point 9: the round's start state is the one to come
            core.restore()
        finally:
            core.leave()

    def _take_round(self) -> None:
        core = self._core
        core.adopt(HANDOFF_WAIT)
        core.rounds_applied += 1
        if core.finished and self._thread is not None:
            self._thread.join(timeout=60)
        if self._group is not None:
            self._sync()

    def _sync(self) -> None:
        """Point 6: rank 0's whole model state (the applied state, with its buffers and the
        run's fixed tensors) and ``finished`` to every rank."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import distribute_tensor

        src = dist.get_global_rank(self._group, 0)
        state = self._core.state
        module = self._core.model.module
        with torch.no_grad():
            held = trainable(module)
            for name, t in sorted(module.state_dict(keep_vars=True).items()):
                if name not in held and not is_sharded(t):  # buffers and frozen tensors
                    dist.broadcast(t.data, src=src, group=self._group)
            for name, p in sorted(held.items()):
                if not is_sharded(p):
                    dist.broadcast(p.data, src=src, group=self._group)
                    continue
                whole = torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
                if self._rank == 0:
                    assert state is not None
                    whole.copy_(torch.from_numpy(state.params[name]))
                shard = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=0)
                p.to_local().copy_(shard.to_local())
            flag = torch.tensor([int(self._core.finished)], dtype=torch.int64)
            dist.broadcast(flag, src=src, group=self._group)
        self._core.finished = bool(flag.item())

    def close(self) -> None:
        self._core.handoff.close()
        self._core.close()
        if self._thread is not None:
            self._thread.join(timeout=60)
