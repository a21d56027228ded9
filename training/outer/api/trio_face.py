"""The trio face of :mod:`training.outer.api`: ``async with open_outer_loop(...)``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.outer.api.clock import RoundTiming
from training.outer.api.core import JOIN_WAIT, Core, load_spec, run_worker, wants_fetch
from training.outer.api.handoff import HANDOFF_WAIT, OuterLoopError, describe
from training.outer.api.scoring import eval_data_of
from training.outer.verification import Level

if TYPE_CHECKING:
    import torch

    from identity import MachineKey, Signer


class AsyncOuterLoop:
    """The trio face: ``await join()`` and ``await step()`` (see :func:`open_outer_loop`)."""

    def __init__(
        self,
        core: Core,
        nursery: Any,
        node: Any,
        key: MachineKey | Signer,
        cert: Path,
        result_path: Path | None,
        resume: bool = False,
    ) -> None:
        self._resume = resume
        self._core = core
        self._nursery = nursery
        self._node = node
        self._key = key
        self._cert = cert
        self._result_path = result_path

    @property
    def level(self) -> Level:
        """The verification level this worker offers (``bounded``, ``scored``)."""
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
        return self._core.result

    @property
    def timings(self) -> list[RoundTiming]:
        """As :attr:`OuterLoop.timings <training.outer.api.OuterLoop.timings>`."""
        return self._core.timings

    async def join(self) -> None:
        import trio

        from identity import Signer, SoftwareSigner

        core = self._core
        core.author = self._key.peer_id
        key = self._key
        signer = key if isinstance(key, Signer) else SoftwareSigner(key)
        if self._resume:
            await trio.to_thread.run_sync(core.resume_from, self._node.store)

        async def main() -> None:
            try:
                result = await run_worker(core, self._node, signer, self._cert, self._result_path)
            except Exception as exc:  # reported to the user's task by the hand-off
                core.worker_done(None, describe(exc))
            else:
                core.worker_done(result, None)

        self._nursery.start_soon(main)
        if not await trio.to_thread.run_sync(
            partial(core.adopt, JOIN_WAIT),
            abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-stubs predate it (trio 0.23)
        ):
            raise OuterLoopError(f"run {core.spec.run} ended before this worker joined")

    async def step(self, loss: float | None = None) -> bool:
        """As :meth:`OuterLoop.step <training.outer.api.OuterLoop.step>`."""
        core = self._core
        core.enter()  # point 9: every second in here is the loop's
        try:
            return await self._step(loss)
        finally:
            core.leave()

    async def _step(self, loss: float | None) -> bool:
        import trio

        core = self._core
        core.poll()  # point 9: a state that came while the steps ran
        if core.finished:
            return True
        if not core.count(loss):
            return False
        if core.overlap:
            if core.in_flight:
                await trio.to_thread.run_sync(
                    core.wait_base,
                    abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-stubs predate it
                )
                if core.finished:
                    return True
            core.launch(self._node.store)  # point 9: the round's end behind the steps
            return True
        core.send()
        await trio.to_thread.run_sync(core.keep, self._node.store)
        await self._take_round()
        return True

    async def skip(self) -> bool:
        """As :meth:`OuterLoop.skip <training.outer.api.OuterLoop.skip>`."""
        import trio

        core = self._core
        core.enter()
        try:
            if core.in_flight:
                await trio.to_thread.run_sync(core.wait_base)
            core.skip()
            await self._take_round()
        finally:
            core.leave()
        return True

    def restore(self) -> None:
        """As :meth:`OuterLoop.restore <training.outer.api.OuterLoop.restore>`."""
        self._core.restore()

    async def _take_round(self) -> None:
        import trio

        core = self._core
        await trio.to_thread.run_sync(
            partial(core.adopt, HANDOFF_WAIT),
            abandon_on_cancel=True,  # type: ignore[call-arg]  # trio-stubs predate it (trio 0.23)
        )
        core.rounds_applied += 1


@asynccontextmanager
async def open_outer_loop(
    node: Any,
    *,
    key: MachineKey | Signer,
    spec: str,
    model: torch.nn.Module,
    certificate: str | Path,
    rounds: int | None = None,
    eval_fn: Callable[[Any, Any], Any] | None = None,
    eval_data: Any = None,
    bootstrap: Sequence[str] = (),
    result_path: str | Path | None = None,
    late: bool = False,
    keep_states: int | None = None,
    inner_optimizer: torch.optim.Optimizer | None = None,
    resume: bool = False,
) -> AsyncIterator[AsyncOuterLoop]:
    """The trio face of :class:`OuterLoop` on a ``p2p.Node`` opened with ``pubsub=True``
    and ``key`` (its machine key, or on a TPM-bound machine its
    ``identity.machine_signer``, whose attestations then carry the AK's co-signature).
    The options are :class:`OuterLoop`'s, less ``group`` and the replayed level's."""
    import trio

    evaluation = eval_data_of(node.store, eval_data) if eval_fn is not None else None
    if wants_fetch(node.store, spec, bootstrap):
        await node.fetch(spec, providers=list(bootstrap))  # a spec ID the store lacks
    spec_blob, run_spec = load_spec(node.store, spec)
    core = Core(
        spec=run_spec,
        spec_blob=spec_blob,
        model=model,
        rounds=rounds,
        eval_fn=eval_fn,
        eval_data=evaluation,
        bootstrap=bootstrap,
        keep_states=keep_states,
        optimizer=inner_optimizer,
    )
    core.join = late
    out = Path(result_path) if result_path is not None else None
    async with trio.open_nursery() as nursery:
        try:
            yield AsyncOuterLoop(core, nursery, node, key, Path(certificate), out, resume)
        finally:
            core.handoff.close()
            await trio.to_thread.run_sync(core.close)  # point 9: the round's end, if any
