"""A striped fetch leaves its first connection to control streams (p2p.fetch.downloader rule 9):
a busy seeder's bulk connections hold megabytes unsent, and a `status` or `peers` answer
queued behind them waited seconds."""

from __future__ import annotations

from p2p.fetch.download_lanes import quiet_lane


def test_bulk_streams_leave_the_first_connection_to_control_streams() -> None:
    lanes = [1]
    assert quiet_lane(lanes) == 0  # one connection: it carries everything
    lanes = [1, 0, 0, 0]
    picked = [quiet_lane(lanes) for _ in range(6)]
    assert picked == [1, 2, 3, 1, 2, 3]
    assert lanes[0] == 1  # nothing more on lane 0
