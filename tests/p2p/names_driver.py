"""A blobnet node in its own process that runs catalog commands read from stdin.

Used by ``test_names_network.py`` until ``blob serve`` installs the catalog itself:
``python names_driver.py STORE KEY [BOOTSTRAP...]`` prints one JSON ready line
(``peer_id``, ``addrs``), then answers each JSON command line with one JSON line. Every
answer has ``ok``; failures carry ``error`` (the message) and ``type`` (the class name).
Commands: connect, put, publish, resolve, catalog, fetch, push_raw, hostile_answers, stop.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import trio
from libp2p.custom_types import TProtocol

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from p2p.blob.shell import close_quietly, write_all  # noqa: E402
from p2p.names import protocol as wire  # noqa: E402
from p2p.names import service as names  # noqa: E402
from p2p.node.node import open_node  # noqa: E402

# A command that takes longer than this is a hang: answer with an error instead.
COMMAND_TIMEOUT = 30.0


async def _lines(stream: trio.lowlevel.FdStream) -> Any:
    buffer = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


async def _hostile_handler(raw: bytes, stream: Any) -> None:
    """Answer any names request with ``raw`` as the record (a lying peer)."""
    await write_all(stream, wire.encode(wire.RecordResponse(raw)))
    await close_quietly(stream)


async def _run(node: Any, command: dict[str, Any]) -> dict[str, Any]:
    op = command["op"]
    if op == "connect":
        return {"peer": await node.connect(command["addr"])}
    if op == "put":
        return {"id": await node.add_bytes(bytes.fromhex(command["data"]))}
    if op == "publish":
        spread = await names.publish(
            node,
            command["name"],
            command["blob"],
            seq=command.get("seq"),
            expiry_s=command.get("expiry_s"),
            push=command.get("push", True),
            use_dht=command.get("dht", True),
        )
        return spread.to_json()
    if op == "resolve":
        started = time.monotonic()
        record = await names.resolve(
            node,
            command["ref"],
            use_peers=command.get("peers", True),
            use_dht=command.get("dht", True),
        )
        return {**record.to_json(), "seconds": time.monotonic() - started}
    if op == "catalog":
        records = await names.catalog(node, command["publisher"])
        return {"names": [r.to_json() for r in records]}
    if op == "fetch":
        blob_id = await node.fetch(command["id"], announce=False)
        return {"id": blob_id, "path": str(node.store.path(blob_id))}
    if op == "push_raw":
        response = await names.request(
            node, command["peer"], wire.PutRequest(bytes.fromhex(command["record"]))
        )
        assert isinstance(response, wire.PutResponse), response
        return {"accepted": response.ok, "reason": response.reason}
    if op == "hostile_answers":
        raw = bytes.fromhex(command["record"])

        async def handler(stream: Any) -> None:
            await _hostile_handler(raw, stream)

        node.host.set_stream_handler(TProtocol(wire.PROTOCOL_ID), handler)
        return {}
    raise ValueError(f"unknown command {op!r}")


async def main(store: str, key: str, bootstrap: list[str]) -> None:
    async with open_node(store, key_path=key, bootstrap=bootstrap) as node:
        names.install(node)
        print(json.dumps({"peer_id": node.peer_id, "addrs": node.addrs}), flush=True)
        stdin = trio.lowlevel.FdStream(os.dup(0))
        async for command in _lines(stdin):
            if command["op"] == "stop":
                break
            try:
                with trio.fail_after(COMMAND_TIMEOUT):
                    answer = {"ok": True, **await _run(node, command)}
            except Exception as exc:  # reported to the test, which decides
                answer = {"ok": False, "error": str(exc), "type": type(exc).__name__}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3:])
