"""The progress bar of a resumed fetch starts at the bytes already held, and its rate
counts only the bytes fetched in this run (from zero, the held half of the blob would look
as if it arrived in the first instant)."""

from __future__ import annotations

from p2p.cli.get import ProgressBar
from p2p.fetch.download_parts import Progress

MiB = 1024 * 1024


def test_resumed_fetch_bar_starts_at_held_bytes_with_a_true_rate() -> None:
    bar = ProgressBar(enabled=True)
    try:
        # 50 MiB were held before this run; 10 MiB arrived in its first 2 seconds.
        bar(
            Progress(
                blob_id="ab" * 32,
                total_bytes=100 * MiB,
                done_bytes=60 * MiB,
                rate_bytes_per_s=5 * MiB,
                elapsed=2.0,
            )
        )
        shown = bar.bar.format_dict
        assert shown["initial"] == 50 * MiB
        assert shown["n"] == 60 * MiB
        rate = (shown["n"] - shown["initial"]) / shown["elapsed"]
        assert 4 * MiB < rate <= 5 * MiB  # the bar's clock began with the fetch
    finally:
        bar.close()
