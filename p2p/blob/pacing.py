"""An upload rate limit: a token bucket, sans-IO (time is the ``now`` argument).

A node that serves while it fetches (a checkpoint crosses its seeder's uplink about once
because every fetcher hands on what it has) spends its own uplink on others;
``blob get --upload-limit`` / ``NodeConfig.upload_limit`` caps what it sends, as every
BitTorrent client lets its user do. The server asks `Pacer.delay` before each chunk it
sends and sleeps that long; all its streams share the one bucket.

Rule: the bucket holds at most ``burst`` bytes of credit and refills at ``rate`` bytes per
second. Sending ``n`` bytes takes ``n`` from it, and may take it below zero (one chunk is
sent whole, however large); the sender then waits until the debt is repaid, so over any
interval longer than a few chunks the bytes sent stay within ``rate * interval + burst``
plus one chunk. Hand-written rather than a library: the rate limiters on PyPI are
asyncio's (aiolimiter) or count calls, not bytes.
"""

from __future__ import annotations

# Credit kept for a quiet sender: a quarter second of its rate, so a burst after a pause
# is short against the rate, but at least one 1 MiB chunk so that one chunk never waits.
BURST_SECONDS = 0.25
MIN_BURST_BYTES = 1 << 20
# The lowest limit worth setting: a fetcher drops a provider slower than 256 KiB/s per
# request as stalled (p2p.fetch.scheduler's min_rate_bytes_per_s), so less serves nobody.
MIN_UPLOAD_LIMIT = 256 * 1024


class Pacer:
    """A token bucket of ``rate`` bytes per second."""

    def __init__(self, rate: float, now: float) -> None:
        if not rate >= MIN_UPLOAD_LIMIT:
            raise ValueError(
                f"an upload limit must be at least {MIN_UPLOAD_LIMIT} bytes/s, not {rate}"
            )
        self.rate = float(rate)
        self.burst = max(MIN_BURST_BYTES, self.rate * BURST_SECONDS)
        self._credit = self.burst
        self._at = now

    def delay(self, nbytes: int, now: float) -> float:
        """Take ``nbytes``; the seconds to wait before sending them (0.0: at once)."""
        if now > self._at:
            self._credit = min(self.burst, self._credit + (now - self._at) * self.rate)
            self._at = now
        wait = 0.0 if self._credit >= 0.0 else -self._credit / self.rate
        self._credit -= nbytes
        return wait
