"""A download's tally: the bytes each provider delivered first, endgame duplicates, when
the first body arrived, and the rate-limited progress reports made from them."""

from __future__ import annotations

from blobstore import Manifest
from p2p.fetch.download_parts import PROGRESS_INTERVAL, Progress, ProgressCallback
from p2p.fetch.scheduler import Scheduler


class Tally:
    """What one transfer has delivered, and its progress reports (``progress``: where they
    go; None: counted, not reported). ``now``: the time the transfer starts."""

    def __init__(
        self,
        manifest: Manifest,
        scheduler: Scheduler,
        progress: ProgressCallback | None,
        now: float,
    ) -> None:
        self._manifest = manifest
        self._scheduler = scheduler
        self._progress = progress
        self._started = now
        self.first_body_at: float | None = None  # see Progress.transfer_rate_bytes_per_s
        self._start_bytes = self.done_bytes()
        self._last_progress = 0.0
        self.new_bytes: dict[str, int] = {}
        self.duplicate_bytes = 0

    def done_bytes(self) -> int:
        """Bytes of the chunks verified so far."""
        manifest = self._manifest
        missing = self._scheduler.missing()
        return manifest.size - sum(manifest.chunk_span(i)[1] for i in missing)

    def on_chunk(self, peer: str, length: int, now: float, *, duplicate: bool) -> None:
        """``peer`` delivered a chunk of ``length`` bytes: the first copy written, or a
        ``duplicate`` of one already verified."""
        if duplicate:
            self.duplicate_bytes += length
            return
        self.new_bytes[peer] = self.new_bytes.get(peer, 0) + length
        self.report(now)

    def note_first_body(self, at: float | None) -> None:
        """A stream's first chunk body began to arrive ``at`` (None: none has)."""
        if at is not None and (self.first_body_at is None or at < self.first_body_at):
            self.first_body_at = at

    def report(self, now: float, *, force: bool = False) -> None:
        """Report progress, at most every PROGRESS_INTERVAL unless ``force``d (exact bytes
        then; else the verified chunks' count times the chunk size, which is cheaper)."""
        if self._progress is None:
            return
        if not force and now - self._last_progress < PROGRESS_INTERVAL:
            return
        self._last_progress = now
        manifest = self._manifest
        scheduler = self._scheduler
        elapsed = max(now - self._started, 1e-9)
        done = (
            self.done_bytes()
            if force
            else min(manifest.size, scheduler.verified_count * manifest.chunk_size)
        )
        receiving = 0.0 if self.first_body_at is None else now - self.first_body_at
        self._progress(
            Progress(
                blob_id=manifest.blob_id,
                total_bytes=manifest.size,
                done_bytes=done,
                rate_bytes_per_s=(done - self._start_bytes) / elapsed,
                transfer_rate_bytes_per_s=(
                    (done - self._start_bytes) / receiving if receiving > 0 else 0.0
                ),
                elapsed=elapsed,
                peers=scheduler.peer_stats(),
                new_bytes=dict(self.new_bytes),
                duplicate_bytes=self.duplicate_bytes,
                finished=scheduler.done,
            )
        )
