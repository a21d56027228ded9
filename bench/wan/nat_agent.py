"""One blobnet node with relay v2 / DCUtR roles, run inside a testbed host (a process per
role, driven over stdin/stdout JSON lines by :mod:`bench.wan.natnodes`)::

    python -m bench.wan.nat_agent relay    --listen ADDR [--trust HEX] [--open]
    python -m bench.wan.nat_agent provider --listen ADDR [--relay RELAY] --size N [--seed S]
    python -m bench.wan.nat_agent fetcher  --listen ADDR --blob ID --provider ADDR ...

(``--no-syn-retry`` on a provider or fetcher: hole punches send one SYN per window.)

Every role prints ``{"ready": true, ...}`` when up. The relay then answers ``stats`` on
stdin with its relayed byte count; the provider serves until killed; the fetcher dials
its providers (circuit addresses through their relays, hole-punched), fetches the blob and
prints one result line (``p2p.nat.punch.NatFetch``, or ``{"error": ...}``), then exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _lines() -> Any:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    buf = b""
    while True:
        data = await stdin.receive_some(4096)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode().strip()


def _configure_punch(host: Any, args: argparse.Namespace) -> None:
    """``--no-syn-retry``: one SYN per punch window, as py-libp2p's own dial (a control)."""
    if args.no_syn_retry:
        from p2p.nat.holepunch import punch_book
        from p2p.nat.syn import NO_RETRY

        punch_book(host).schedule = NO_RETRY


async def run_relay(args: argparse.Namespace, store: str) -> None:
    from identity import TrustStore
    from p2p.nat.relay import control_limits, relay_service
    from p2p.node.node import open_node

    trust = TrustStore(frozenset(bytes.fromhex(h) for h in args.trust)) if args.trust else None
    limits = control_limits(max_bytes=args.max_bytes) if args.max_bytes else control_limits()
    async with open_node(
        store, listen=[args.listen], dht=args.dht, bootstrap=args.bootstrap, fast=not args.slow
    ) as node:
        admitted = None if trust is not None else (lambda peer: True)
        async with relay_service(
            node.host, trust=trust, admitted=admitted, limits=limits, open_connect=args.open
        ) as relay:
            _emit({"ready": True, "peer_id": node.peer_id, "addrs": node.addrs})
            async for line in _lines():
                if line == "stats":
                    _emit({"relayed_bytes": relay.relayed_bytes, "refused": relay.refused})


async def run_provider(args: argparse.Namespace, store: str) -> None:
    from p2p.nat.punch import reachable
    from p2p.node.node import open_node

    async with open_node(
        store, listen=[args.listen], dht=args.dht, bootstrap=args.bootstrap, fast=not args.slow
    ) as node:
        _configure_punch(node.host, args)
        data = random.Random(args.seed).randbytes(args.size)
        blob_id = await node.add_bytes(data) if args.size else ""
        relays = [args.relay] if args.relay else []
        async with reachable(node.host, relays, certificate=args.cert_bytes) as reach:
            if args.dht and blob_id:
                await node.provide(blob_id)  # again: the record now names the circuit
            _emit(
                {
                    "ready": True,
                    "peer_id": node.peer_id,
                    "blob": blob_id,
                    "public": reach.reachability.public,
                    "detail": reach.reachability.detail,
                    "addrs": reach.addrs,
                    "node_addrs": node.addrs,
                    "circuit_addrs": [a for r in reach.reservations for a in r.circuit_addrs],
                    "problems": reach.problems,
                }
            )
            await trio.sleep_forever()


async def run_fetcher(args: argparse.Namespace, store: str) -> None:
    from p2p.nat.punch import NatUnreachable, fetch_with_nat
    from p2p.node.node import NodeConfig, open_node

    t0 = time.monotonic()
    # --allow-relayed: the node may fetch over a relayed connection too (as `blob get
    # --allow-relayed` sets it), else it waits for a direct one that never comes.
    config = NodeConfig(
        listen=(args.listen,), bootstrap=tuple(args.bootstrap), dht=args.dht,
        fast=not args.slow, relayed_fetch=args.allow_relayed,
    )  # fmt: skip
    async with open_node(store, config=config) as node:
        _configure_punch(node.host, args)
        _emit({"ready": True, "peer_id": node.peer_id})
        fetch_started_at = time.time()
        try:
            outcome = await fetch_with_nat(
                node,
                args.blob,
                args.provider,
                certificate=args.cert_bytes,
                allow_relayed=args.allow_relayed,
                punch_timeout=args.timeout,
                discover=args.discover,
            )
        except NatUnreachable as exc:
            _emit({"error": str(exc), "total_s": time.monotonic() - t0})
            return
        except Exception as exc:  # the fetch's own error, reported as a result
            _emit({"error": f"fetch failed: {exc}", "total_s": time.monotonic() - t0})
            return
        result = outcome.to_json()
        result["total_s"] = time.monotonic() - t0
        result["fetch_started_at"] = fetch_started_at  # wall clock, for outside timing
        _emit(result)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["relay", "provider", "fetcher"])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--relay", default="")
    parser.add_argument("--trust", action="append", default=[])
    parser.add_argument("--open", action="store_true")
    parser.add_argument("--max-bytes", type=int, default=0)
    parser.add_argument("--size", type=int, default=0)
    parser.add_argument("--cert", default="")
    parser.add_argument("--provider", action="append", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blob", default="")
    parser.add_argument("--allow-relayed", action="store_true")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--slow", action="store_true", help="py-libp2p's own Noise/yamux")
    parser.add_argument("--debug", action="store_true")
    parser.add_argument(
        "--debug-logger", action="append", default=[],
        help="this logger (and its children) at DEBUG, the rest as --debug says",
    )  # fmt: skip
    parser.add_argument(
        "--no-syn-retry", action="store_true", help="one SYN per punch window (a control)"
    )
    parser.add_argument("--dht", action="store_true", help="run the Kademlia DHT")
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--discover", action="store_true", help="fetcher: ask the DHT too")
    args = parser.parse_args()
    args.cert_bytes = Path(args.cert).read_bytes() if args.cert else None
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(created).6f %(name)s %(levelname)s %(message)s",
    )
    for name in args.debug_logger:  # py-libp2p's loggers do not propagate: a handler each
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.handlers = logging.getLogger().handlers
        logger.propagate = False
    with tempfile.TemporaryDirectory(prefix="blobnat-") as store:
        runner = {"relay": run_relay, "provider": run_provider, "fetcher": run_fetcher}
        try:
            trio.run(runner[args.role], args, store)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
