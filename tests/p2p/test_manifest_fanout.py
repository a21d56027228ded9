"""The downloader asks several providers for the manifest at once: a stale provider record
(a peer that never answers) must not delay the start of a fetch by its whole timeout; and
a named provider still being dialled is waited for, past the discovery timeout.

Runs on trio's autojump clock, so timeouts cost virtual time only, and over in-memory
streams whose far end is a real sans-IO ServerConnection.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fake_stream import FakeStream
from thread_clock import thread_aware_clock

from blobstore import Manifest, Store
from p2p.blob import messages
from p2p.blob import protocol as proto
from p2p.errors import NoProviders
from p2p.fetch import download_parts, downloader

CHUNK = 64 * 1024
DATA = os.urandom(3 * CHUNK + 5)
MANIFEST = Manifest.of_bytes(DATA, chunk_size=CHUNK)
BLOB_ID = MANIFEST.blob_id


def answering(manifest: bytes) -> FakeStream:
    def serve(server: proto.ServerConnection, request: messages.Request) -> tuple[bytes, bool]:
        assert isinstance(request, messages.ManifestRequest)
        return server.send_response(messages.ManifestResponse(manifest)), False

    return FakeStream(serve)


def holding() -> FakeStream:
    """A provider with the whole blob: manifest, ``have`` and chunks."""

    def serve(server: proto.ServerConnection, request: messages.Request) -> tuple[bytes, bool]:
        if isinstance(request, messages.ManifestRequest):
            return server.send_response(messages.ManifestResponse(MANIFEST.encode())), False
        n = MANIFEST.num_chunks
        if isinstance(request, messages.HaveRequest):
            bits = bytes([0xFF] * (n // 8) + [(1 << (n % 8)) - 1])
            return server.send_response(messages.HaveResponse(n, bits)), False
        assert isinstance(request, messages.GetRequest)
        out = bytearray()
        for start, stop in request.ranges:
            for i in range(start, stop):
                offset, length = MANIFEST.chunk_span(i)
                out += server.send_chunk_header(i, length) + DATA[offset : offset + length]
        return bytes(out + server.send_response(messages.End(()))), False

    return FakeStream(serve)


def not_held() -> FakeStream:
    def serve(server: proto.ServerConnection, request: messages.Request) -> tuple[bytes, bool]:
        error = messages.ErrorResponse(messages.ErrorCode.NOT_FOUND, "no such blob here")
        return server.send_response(error), False

    return FakeStream(serve)


BUDGET_TAKEN = "streams: the server is at its limit of 256"


def busy() -> FakeStream:
    def serve(server: proto.ServerConnection, request: messages.Request) -> tuple[bytes, bool]:
        return server.send_response(
            messages.ErrorResponse(messages.ErrorCode.BUSY, BUDGET_TAKEN)
        ), False

    return FakeStream(serve)


class Network:
    """Peers by name: "silent" ones never open a stream, "silent-once" ones only the first
    time, "liar" ones send a manifest that does not match the ID, "busy" ones answer at
    once that their stream budget is taken, "reset" ones end the stream at once unanswered,
    "not-held" ones answer that they do not hold the blob, "good" ones answer (and serve
    the blob's chunks)."""

    def __init__(self, kinds: dict[str, str]) -> None:
        self.kinds = kinds
        self.opened: list[str] = []

    async def open_blob_stream(self, peer: str) -> Any:
        self.opened.append(peer)
        kind = self.kinds[peer]
        if kind == "silent" or (kind == "silent-once" and self.opened.count(peer) == 1):
            await trio.sleep_forever()
        if kind == "busy":
            return busy()
        if kind == "reset":
            return FakeStream(lambda server, request: (b"", True))
        if kind == "not-held":
            return not_held()
        if kind == "liar":
            other = Manifest.of_bytes(b"something else", chunk_size=CHUNK)
            return answering(other.encode())
        return holding()


async def fetch(network: Network, candidates: list[str], more: Any = None) -> Manifest:
    return await downloader._manifest_from_network(
        network, BLOB_ID, candidates, set(), more, discovery_timeout=10.0
    )


async def test_silent_peers_do_not_delay_the_manifest(autojump_clock: trio.abc.Clock) -> None:
    silent = [f"silent{i}" for i in range(download_parts.MANIFEST_FANOUT - 1)]
    network = Network({**dict.fromkeys(silent, "silent"), "liar": "liar", "good": "good"})
    start = trio.current_time()
    manifest = await fetch(network, [*silent, "liar", "good"])
    assert manifest.blob_id == BLOB_ID
    # One at a time, each silent peer would have cost CONTROL_TIMEOUT first.
    assert trio.current_time() - start < download_parts.CONTROL_TIMEOUT
    assert "good" in network.opened


async def test_at_most_fanout_peers_are_asked_at_once(autojump_clock: trio.abc.Clock) -> None:
    silent = [f"silent{i}" for i in range(download_parts.MANIFEST_FANOUT + 2)]
    network = Network({**dict.fromkeys(silent, "silent"), "good": "good"})
    start = trio.current_time()
    manifest = await fetch(network, [*silent, "good"])
    assert manifest.blob_id == BLOB_ID
    # The first FANOUT silent peers held every slot until their timeout; only then were
    # the others (and the good one) asked.
    waited = trio.current_time() - start
    assert download_parts.CONTROL_TIMEOUT <= waited < 2 * download_parts.CONTROL_TIMEOUT
    assert (
        network.opened[: download_parts.MANIFEST_FANOUT] == silent[: download_parts.MANIFEST_FANOUT]
    )


async def test_a_peer_found_later_by_discovery_is_asked(autojump_clock: trio.abc.Clock) -> None:
    network = Network({"silent": "silent", "late": "good"})
    send, receive = trio.open_memory_channel[str](4)
    candidates = ["silent"]

    async def discover() -> None:
        await trio.sleep(1.0)
        await send.send("late")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(discover)
        manifest = await fetch(network, candidates, receive)
    assert manifest.blob_id == BLOB_ID
    assert candidates == ["silent", "late"]  # kept for the transfer that follows


async def test_no_good_answer_is_no_providers(autojump_clock: trio.abc.Clock) -> None:
    network = Network({"silent": "silent", "liar": "liar"})
    with pytest.raises(NoProviders, match="none of 2"):
        await fetch(network, ["silent", "liar"])
    with pytest.raises(NoProviders, match="no provider"):
        await fetch(network, [])


async def test_a_peer_that_did_not_answer_is_asked_again(autojump_clock: trio.abc.Clock) -> None:
    """A seeder whose uplink another fetch fills can hold a newcomer's answer past the
    timeout (the fan-out bench shows it): with it the only provider, the fetch must not
    end with "none of 1 peer(s) asked holds" although the peer holds it."""
    network = Network({"busy-seeder": "silent-once"})
    start = trio.current_time()
    manifest = await fetch(network, ["busy-seeder"])
    assert manifest.blob_id == BLOB_ID
    assert network.opened == ["busy-seeder", "busy-seeder"]
    assert trio.current_time() - start >= download_parts.CONTROL_TIMEOUT


async def test_a_peer_that_never_answers_is_asked_a_bounded_number_of_times(
    autojump_clock: trio.abc.Clock,
) -> None:
    network = Network({"silent": "silent", "liar": "liar"})
    with pytest.raises(NoProviders, match=r"\(3 tries each\): 1 did not answer within 15 s$"):
        await fetch(network, ["silent", "liar"])
    assert network.opened.count("silent") == 1 + len(download_parts.MANIFEST_RETRY_PAUSES)
    assert network.opened.count("liar") == 1  # an answer, even a wrong one, is not retried


async def test_a_busy_peer_is_said_to_be_busy(autojump_clock: trio.abc.Clock) -> None:
    """A saturated server answers at once that its stream budget is taken; the fetch used
    to say it "did not answer within 15 s", sending the user after a network fault."""
    network = Network({"saturated": "busy", "silent": "silent"})
    with pytest.raises(NoProviders) as caught:
        await fetch(network, ["saturated", "silent"])
    message = str(caught.value)
    assert f"saturated was busy: {BUDGET_TAKEN}" in message
    assert "1 did not answer within 15 s" in message
    assert network.opened.count("saturated") == 1 + len(download_parts.MANIFEST_RETRY_PAUSES)


async def test_a_peer_that_ends_the_stream_at_once_is_not_said_to_be_silent(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A server that resets a stream it cannot take (its refusals are full) ends the request
    at once: the fetch used to count it among those that "did not answer within 15 s",
    sending the user to look for a network fault where no time passed."""
    network = Network({"resetting": "reset", "silent": "silent"})
    with pytest.raises(NoProviders) as caught:
        await fetch(network, ["resetting", "silent"])
    message = str(caught.value)
    assert "1 did not answer within 15 s" in message  # only the silent one
    assert "resetting closed or reset the stream unanswered (" in message
    assert network.opened.count("resetting") == 1 + len(download_parts.MANIFEST_RETRY_PAUSES)


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> trio.testing.MockClock:
    """Virtual time that jumps once every task has been blocked for 10 ms of real time,
    and never while the store works in a thread (thread_clock says why)."""
    return thread_aware_clock(monkeypatch, threshold=0.01).clock


@pytest.mark.parametrize("resumed", [False, True], ids=["manifest", "transfer"])
async def test_a_named_provider_that_connects_late_is_waited_for(
    tmp_path: Path, virtual_clock: trio.abc.Clock, resumed: bool
) -> None:
    """Under load one named provider's dial outlasted the discovery timeout while the other
    answered at once that it does not hold the blob: the fetch ended with "none of 1
    peer(s) asked holds" (or, resuming from a partial blob, "could not be fetched")
    although the late one held it. Only the dial's own timeout may end that wait."""
    network = Network({"without": "not-held", "late": "good"})
    store = Store.open(tmp_path / "s")
    if resumed:
        store.begin_partial(MANIFEST).close()
    send, named = trio.open_memory_channel[str](1)
    discovery_timeout = 10.0

    async def dial_late() -> None:
        async with send:
            await trio.sleep(discovery_timeout + 5)  # DIAL_TIMEOUT is 15 s
            await send.send("late")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(dial_late)
        await downloader.download_blob(
            network,
            store,
            BLOB_ID,
            providers=["without"],
            named_providers=named,
            discovery_timeout=discovery_timeout,
        )
    assert store.path(BLOB_ID).read_bytes() == DATA
    assert network.opened[0] == "without"
    assert "late" in network.opened
