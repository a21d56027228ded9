"""A download's state and bookkeeping: the attributes every part of
:class:`~p2p.fetch.downloader.Download` shares, chunk lengths, byte counts and progress reports."""

from __future__ import annotations

import trio

from blobstore import (
    Manifest,
    PartialBlob,
    Store,
)
from p2p.blob.buffers import ChunkBuffers
from p2p.blob.pacing import Pacer
from p2p.fetch.chunk_writer import ChunkWriter
from p2p.fetch.download_parts import (
    IDLE_WAKE_S,
    PROGRESS_INTERVAL,
    Network,
    Progress,
    ProgressCallback,
    StripedNetwork,
)
from p2p.fetch.download_probes import HaveProbes
from p2p.fetch.scheduler import (
    Scheduler,
    SchedulerConfig,
)
from p2p.fetch.scores import PeerScores
from p2p.fetch.striping import StripeConfig, StripeGrowth


class DownloadState:
    """The state of one transfer (set by ``Download.__init__``) and its bookkeeping."""

    network: Network
    probes: HaveProbes | None
    scores: PeerScores | None
    pacer: Pacer | None
    store: Store
    manifest: Manifest
    blob_id: str
    partial: PartialBlob
    writer: ChunkWriter
    config: SchedulerConfig
    progress: ProgressCallback | None
    scheduler: Scheduler
    buffers: ChunkBuffers
    writing: dict[int, trio.Event]
    changed: trio.Event
    peers_seen: set[str]
    peer_tasks: int
    started: float
    first_body_at: float | None
    start_bytes: int
    last_progress: float
    new_bytes: dict[str, int]
    duplicate_bytes: int
    penalized: set[str]
    striped: StripedNetwork | None
    stripe_config: StripeConfig | None
    growth: dict[str, StripeGrowth]
    lane_load: dict[str, list[int]]
    serial: set[str]

    def chunk_length(self, index: int) -> int:
        return self.manifest.chunk_span(index)[1]

    def _done_bytes(self) -> int:
        missing = self.scheduler.missing()
        return self.manifest.size - sum(self.manifest.chunk_span(i)[1] for i in missing)

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _idle_wait(self) -> float:
        """How long an idle worker may sleep: until the next request turns late (an
        endgame copy may be due then), at most IDLE_WAKE_S."""
        now = trio.current_time()
        late = self.scheduler.next_late_at(now)
        return IDLE_WAKE_S if late is None else min(IDLE_WAKE_S, late - now)

    async def _wait_change(self, seconds: float = IDLE_WAKE_S) -> None:
        with trio.move_on_after(seconds):
            await self.changed.wait()

    def _report(self, *, force: bool = False) -> None:
        if self.progress is None:
            return
        now = trio.current_time()
        if not force and now - self.last_progress < PROGRESS_INTERVAL:
            return
        self.last_progress = now
        elapsed = max(now - self.started, 1e-9)
        done = (
            self.manifest.size
            - sum(self.manifest.chunk_span(i)[1] for i in self.scheduler.missing())
            if force
            else self._approx_done()
        )
        receiving = 0.0 if self.first_body_at is None else now - self.first_body_at
        self.progress(
            Progress(
                blob_id=self.blob_id,
                total_bytes=self.manifest.size,
                done_bytes=done,
                rate_bytes_per_s=(done - self.start_bytes) / elapsed,
                transfer_rate_bytes_per_s=(
                    (done - self.start_bytes) / receiving if receiving > 0 else 0.0
                ),
                elapsed=elapsed,
                peers=self.scheduler.peer_stats(),
                new_bytes=dict(self.new_bytes),
                duplicate_bytes=self.duplicate_bytes,
                finished=self.scheduler.done,
            )
        )

    def _approx_done(self) -> int:
        return min(self.manifest.size, self.scheduler.verified_count * self.manifest.chunk_size)
