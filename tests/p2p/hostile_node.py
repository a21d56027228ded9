"""A node process that misbehaves on purpose, for the integration tests.

Modes:
  flip   serves every chunk with its first byte flipped (a lying peer)
  stall  serves ``--after`` chunks, then stops sending without closing (a stalled peer)
  slow   sleeps ``--delay`` seconds before each chunk (a slow peer)
  eio    every chunk read fails with an I/O error (a failing disk)
  flaky  the first ``have`` fails (its stream is reset), later ones work
  old    an honest server of ``/blobnet/blob/1.0.0`` only, as the first release was: it
         refuses the later versions (pipelining, peer exchange, status)

It runs a real blobnet node over TCP on 127.0.0.1 and its own store; only the store that
the protocol server reads through is wrapped. Prints the same JSON ready line as
``blob serve --json`` and runs until killed.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import trio
from libp2p.custom_types import TProtocol

from blobstore import ChunkReader, Store
from p2p.blob import messages
from p2p.node.node import open_node


class HostileStore:
    """The store as the protocol server sees it, with chunk reads that misbehave."""

    def __init__(
        self, store: Store, mode: str, after: int, delay: float, count_to: Path | None = None
    ) -> None:
        self._store = store
        self._count_to = count_to
        self._mode = mode
        self.mode = mode
        self._after = after
        self._delay = delay
        self._served = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def chunk_bitmap(self, blob_id: str) -> bytes:
        if self._mode == "flaky":
            with self._lock:
                self._served += 1
                first = self._served == 1
            if first:
                raise OSError(errno.EIO, "Input/output error")
        return self._store.chunk_bitmap(blob_id)

    def open_reader(self, blob_id: str) -> HostileReader:
        return HostileReader(self, self._store.open_reader(blob_id))

    def misbehave(self, data: bytes) -> bytes:
        with self._lock:
            self._served += 1
            served = self._served
            if self._count_to is not None:  # for tests that wait until chunks were served
                self._count_to.write_text(str(served))
        if self._mode == "flip":
            return bytes([data[0] ^ 0xFF]) + data[1:]
        if self._mode == "stall" and served > self._after:
            time.sleep(3600)
        if self._mode in ("slow", "old"):
            time.sleep(self._delay)
        return data


class HostileReader:
    def __init__(self, store: HostileStore, reader: ChunkReader) -> None:
        self._store = store
        self._reader = reader

    def read(self, index: int, *, verify: bool = True) -> bytes:
        if self._store.mode == "eio":
            raise OSError(errno.EIO, "Input/output error")
        return self._store.misbehave(self._reader.read(index, verify=verify))

    def read_into(
        self, index: int, out: memoryview, *, verify: bool = True, cached_only: bool = False
    ) -> bool:
        if cached_only:
            return False  # misbehave in the server's worker thread, never on its event loop
        out[:] = self.read(index, verify=verify)
        return True

    def close(self) -> None:
        self._reader.close()


async def main(args: argparse.Namespace) -> None:
    store = Store.open(Path(args.store))
    async with open_node(store, listen=["/ip4/127.0.0.1/tcp/0"], dht=False) as node:
        node.server.store = HostileStore(store, args.mode, args.after, args.delay, args.count_to)  # type: ignore[assignment]
        if args.mode == "old":
            for protocol_id in messages.SERVED_PROTOCOL_IDS:
                if protocol_id != messages.Version.V1_0.protocol_id:
                    node.host.remove_stream_handler(TProtocol(protocol_id))
        print(json.dumps({"peer_id": node.peer_id, "addrs": node.addrs}), flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument(
        "--mode", choices=["flip", "stall", "slow", "eio", "flaky", "old"], required=True
    )
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--count-to", type=Path, default=None, help="write chunks served here")
    try:
        trio.run(main, parser.parse_args())
    except KeyboardInterrupt:
        sys.exit(0)
