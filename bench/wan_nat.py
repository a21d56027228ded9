"""Issue 20's figures: NATed peers fetching through a relay, upgraded by DCUtR.

    python bench/wan_nat.py [--tries 20] [--rtt-ms 80] [--size-mib 4] [--symmetric-tries 3]
                            [--cli-tries 20 [--cli-only]]
    python bench/wan_nat.py --matrix [--matrix-tries 20] [--cells eimreset,eimicmp]
                            [--no-syn-retry] [--json-out F] [--md-out F]

``--matrix`` runs the router matrix instead (bench/wan/nat_matrix.py says what each cell
is and what a try measures) and prints one table row per cell; ``--no-syn-retry`` is the
control (one SYN per punch window, on both sides).

On the WAN testbed: a public relay, a provider behind an endpoint-independent NAT, and a
fetcher behind another, every pair at ``--rtt-ms``. Each try is a fresh fetcher process
(a new key, so a new relayed connection and a new hole punch) fetching the provider's blob
from its circuit address only. Reported per try and summed up: whether the blob came over
a direct connection, the time from the fetcher's process start (what ``blob get`` would
be) to the first verified chunk, the same from its node being up, the punch's own time,
the bytes the relay carried, and where the time goes: connected through the relay
(``relayed_s``), the punch (``punch_s``), direct connection to first chunk.
``--symmetric-tries`` repeats with both peers behind symmetric NATs, where the punch
should fail every time and the fetch say so; ``--relayed-tries`` lets such a pair fetch
through a second relay run with raised limits (``--allow-relayed``). ``--cli-tries``
runs the same as a user does, with real ``blob relay``, ``blob serve --relay`` and
``blob get TICKET`` processes (time from each get's spawn to its first verified byte).

The machine is shared and small: timings include Python start-up on a loaded CPU; compare
the in-node figures across runs, not with other machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.wan import Host, Testbed, unavailable_reason
from bench.wan.natnodes import MiB, NatNodes


def _tries(
    nat: NatNodes, relay: Any, kind: str, tries: int, size: int, *extra: str
) -> list[dict[str, Any]]:
    """``tries`` fetches from ``<kind>p`` by fresh fetchers on ``<kind>f``."""
    [provider] = nat.providers([f"{kind}p"], relay=relay, size=size, seed=tries)
    out = []
    for i in range(tries):
        before = nat.relay_stats(relay)["relayed_bytes"]
        result = nat.fetch(
            f"{kind}f", provider.blob, provider.circuit_addrs, "--timeout", "15", *extra
        )
        relayed = nat.relay_stats(relay)["relayed_bytes"] - before
        punches = result.get("punches") or [{}]
        row = {
            "kind": kind,
            "try": i,
            "direct": punches[0].get("path") == "direct" and "error" not in result,
            "fetched": "error" not in result and result.get("bytes") == size,
            "reason": result.get("error") or punches[0].get("reason", ""),
            "relayed_bytes": relayed,
            "punch_s": None,
            "relayed_s": punches[0].get("relayed_s"),
            "direct_to_first_byte_s": None,
            "first_byte_from_node_s": result.get("first_byte_s"),
            "first_byte_from_start_s": None,
            "startup_s": None,
        }
        if punches[0].get("direct_s") is not None and punches[0].get("relayed_s") is not None:
            row["punch_s"] = punches[0]["direct_s"] - punches[0]["relayed_s"]
            if result.get("first_byte_s") is not None:
                row["direct_to_first_byte_s"] = result["first_byte_s"] - punches[0]["direct_s"]
        if result.get("first_byte_s") is not None:
            started = result["fetch_started_at"]
            row["first_byte_from_start_s"] = started + result["first_byte_s"] - result["spawned_at"]
            row["startup_s"] = started - result["spawned_at"]
        print(json.dumps(row), file=sys.stderr)
        out.append(row)
    return out


def _cli_tries(tb: Testbed, tries: int, size: int, logs: Path) -> list[dict[str, Any]]:
    """``tries`` real ``blob get TICKET`` processes on ``eimf`` (fresh keys) from a real
    ``blob serve --relay`` on ``eimp`` through a real ``blob relay --open-circuits``:
    the time from each get's spawn to its first verified byte, as a user meets it."""
    import random
    import subprocess

    from bench.wan.blobnodes import _readline
    from bench.wan.measure import REPO_ROOT, python_env
    from blobstore import Store
    from identity import Authority, MachineKey
    from identity.keyfile import create_key_file
    from identity.signer import SoftwareSigner
    from p2p.blob.ticket import Ticket

    def blob(host: str, name: str, *args: str) -> subprocess.Popen[str]:
        d = logs / name
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "machine.key").exists():
            create_key_file(d / "machine.key")
        argv = [sys.executable, "-m", "p2p.cli", "--store", str(d / "store")]
        argv += ["--key", str(d / "machine.key"), *args]
        return tb.popen(
            host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=python_env(), cwd=REPO_ROOT,
        )  # fmt: skip

    authority = Authority(SoftwareSigner(MachineKey.generate()))
    relay = blob(
        "relay", "cli-relay", "relay", "--json", "--open-circuits", "--no-dht",
        "--authority", authority.public_key_bytes.hex(),
        "--listen", f"/ip4/{tb.addr('relay')}/tcp/4002",
    )  # fmt: skip
    relay_addr = json.loads(_readline(relay, 90))["addrs"][0]
    (logs / "cli-prov").mkdir(parents=True, exist_ok=True)
    prov_key = create_key_file(logs / "cli-prov" / "machine.key")
    now = int(time.time())
    cert = authority.admit(
        prov_key.peer_id, operator="bench", kernel_class="cpu",
        not_before=now - 60, not_after=now + 3600, serial=now,
    )  # fmt: skip
    (logs / "cli-prov" / "cert").write_bytes(cert.encode())
    blob_id = Store.open(logs / "cli-prov" / "store").put_bytes(random.Random(3).randbytes(size))
    prov = blob(
        "eimp", "cli-prov", "serve", "--json", "--no-dht", "--relay", relay_addr,
        "--certificate", str(logs / "cli-prov" / "cert"),
        "--listen", f"/ip4/{tb.addr('eimp')}/tcp/4003",
    )  # fmt: skip
    ready = json.loads(_readline(prov, 90))
    if ready.get("public") is not False or not ready.get("circuit_addrs"):
        raise SystemExit(f"the provider is not reachable through the relay: {ready}")
    ticket = Ticket(blob_id, tuple(ready["addrs"])).encode()
    out = []
    try:
        for i in range(tries):
            spawned = time.time()
            get = blob("eimf", f"cli-get{i}", "get", ticket, "--json", "--no-upload")
            stdout, stderr = get.communicate(timeout=120)
            lines = stdout.strip().splitlines()
            result = json.loads(lines[-1]) if get.returncode == 0 and lines else {}
            row = {
                "kind": "cli",
                "try": i,
                "fetched": result.get("id") == blob_id,
                "exit": get.returncode,
                "reason": stderr.strip().splitlines()[-1] if get.returncode else "",
                "first_byte_from_start_s": (
                    result["first_byte_at"] - spawned if "first_byte_at" in result else None
                ),
                "first_byte_from_command_s": result.get("first_byte_s"),
            }
            print(json.dumps(row), file=sys.stderr)
            out.append(row)
    finally:
        for proc in (prov, relay):
            proc.terminate()
            proc.communicate(timeout=30)
    return out


def _cli_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float] | None:
        values = [r[key] for r in rows if r[key] is not None]
        if not values:
            return None
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "tries": len(rows),
        "fetched": sum(r["fetched"] for r in rows),
        "success_rate": sum(r["fetched"] for r in rows) / max(1, len(rows)),
        "first_byte_from_start_s": stats("first_byte_from_start_s"),
        "first_byte_from_command_s": stats("first_byte_from_command_s"),
        "reasons": sorted({r["reason"] for r in rows if r["reason"]}),
    }


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float] | None:
        values = [r[key] for r in rows if r[key] is not None]
        if not values:
            return None
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "tries": len(rows),
        "direct": sum(r["direct"] for r in rows),
        "success_rate": sum(r["direct"] for r in rows) / max(1, len(rows)),
        "fetched": sum(r["fetched"] for r in rows),
        "first_byte_from_start_s": stats("first_byte_from_start_s"),
        "first_byte_from_node_s": stats("first_byte_from_node_s"),
        "relayed_s": stats("relayed_s"),
        "punch_s": stats("punch_s"),
        "direct_to_first_byte_s": stats("direct_to_first_byte_s"),
        "startup_s": stats("startup_s"),
        "max_relayed_bytes": max((r["relayed_bytes"] for r in rows), default=0),
        "reasons": sorted({r["reason"].split(" (")[0] for r in rows if r["reason"]}),
    }


def _matrix(args: argparse.Namespace) -> None:
    from bench.wan import nat_matrix

    chosen = nat_matrix.cells()
    if args.cells:
        names = args.cells.split(",")
        chosen = [c for c in chosen if c.name in names]
        if len(chosen) != len(names):
            sys.exit(f"unknown cell in {args.cells}: {[c.name for c in nat_matrix.cells()]}")
    extra = ("--no-syn-retry",) if args.no_syn_retry else ()
    started = time.monotonic()
    summaries = []
    rows: list[dict[str, Any]] = []
    with (
        Testbed(nat_matrix.matrix_hosts(chosen)) as tb,
        tempfile.TemporaryDirectory(prefix="wan-nat-") as logs,
    ):
        nat = NatNodes(tb, logs=Path(logs))
        try:
            relay = nat_matrix.start_relay(nat)
            for cell in chosen:
                tries = args.matrix_tries
                if cell.idle_wait_s or not cell.expect_direct:
                    tries = min(tries, args.slow_cell_tries)
                got = nat_matrix.run_cell(
                    nat, relay, cell, tries, extra=extra,
                    report=lambda row: print(json.dumps(row), file=sys.stderr),
                )  # fmt: skip
                rows += got
                summaries.append(nat_matrix.summarize(cell, got))
                print(json.dumps(summaries[-1]), file=sys.stderr)
        finally:
            nat.stop()
    report = {
        "no_syn_retry": args.no_syn_retry,
        "cells": summaries,
        "rows": rows,
        "wall_s": time.monotonic() - started,
    }
    table = _matrix_table(summaries)
    print(table)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    if args.md_out is not None:
        args.md_out.write_text(table + "\n")


def _matrix_table(summaries: list[dict[str, Any]]) -> str:
    def secs(stats: dict[str, float] | None) -> str:
        return "-" if stats is None else f"{stats['median']:.2f} / {stats['p90']:.2f}"

    lines = [
        "| cell | routers | direct | first try | first direct byte, s (median / p90) "
        "| relay bytes when direct (max) | fallback: first relayed byte, s |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in summaries:
        when_direct = c["relayed_bytes_when_direct"]
        lines.append(
            f"| {c['cell']} | {c['title']} | {c['direct']}/{c['tries']} "
            f"| {c['first_try']}/{c['direct']} | {secs(c['first_direct_byte_s'])} "
            f"| {'-' if when_direct is None else f'{when_direct:,}'} "
            f"| {secs(c['first_relayed_byte_s'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--symmetric-tries", type=int, default=3)
    parser.add_argument("--relayed-tries", type=int, default=2)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--size-mib", type=int, default=4)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument(
        "--cli-tries",
        type=int,
        default=0,
        help="then this many real `blob get TICKET` processes from a `blob serve --relay`",
    )
    parser.add_argument("--cli-only", action="store_true", help="only the --cli-tries")
    parser.add_argument("--matrix", action="store_true", help="the router matrix instead")
    parser.add_argument("--matrix-tries", type=int, default=20)
    parser.add_argument(
        "--slow-cell-tries", type=int, default=5,
        help="tries in the matrix's idle and symmetric cells (each waits 30 s or more)",
    )  # fmt: skip
    parser.add_argument("--cells", default="", help="comma-separated cell names")
    parser.add_argument("--no-syn-retry", action="store_true", help="the control")
    parser.add_argument("--md-out", type=Path)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot run: {reason}")
    if args.matrix:
        _matrix(args)
        return
    delay = args.rtt_ms / 4  # RTT(i, j) = 2 (delay_i + delay_j)
    hosts = {
        "relay": Host(delay_ms=delay),
        "eimp": Host(delay_ms=delay, nat="eim"),
        "eimf": Host(delay_ms=delay, nat="eim"),
        "symp": Host(delay_ms=delay, nat="symmetric"),
        "symf": Host(delay_ms=delay, nat="symmetric"),
        "bulkrelay": Host(delay_ms=delay),
        "relp": Host(delay_ms=delay, nat="symmetric"),
        "relf": Host(delay_ms=delay, nat="symmetric"),
    }
    started = time.monotonic()
    with Testbed(hosts) as tb, tempfile.TemporaryDirectory(prefix="wan-nat-") as logs:
        nat = NatNodes(tb, logs=Path(logs))
        rows: list[dict[str, Any]] = []
        sym: list[dict[str, Any]] = []
        relayed: list[dict[str, Any]] = []
        cli: list[dict[str, Any]] = []
        size = args.size_mib * MiB
        try:
            if args.cli_tries:
                cli = _cli_tries(tb, args.cli_tries, size, Path(logs))
            relay = None if args.cli_only else nat.relay("relay")
            if relay is not None:
                rows = _tries(nat, relay, "eim", args.tries, size)
                sym = _tries(nat, relay, "sym", args.symmetric_tries, size)
            if args.relayed_tries and not args.cli_only:
                # A second relay, run with limits raised for blobs, and fetchers that
                # allow relaying: a symmetric pair's only way.
                bulk = nat.relay("bulkrelay", "--max-bytes", str(4 * size))
                relayed = _tries(nat, bulk, "rel", args.relayed_tries, size, "--allow-relayed")
        finally:
            nat.stop()
    report = {
        "rtt_ms": args.rtt_ms,
        "size_mib": args.size_mib,
        "eim": _summary(rows),
        "symmetric": _summary(sym),
        "relayed_allowed": _summary(relayed),
        "cli": _cli_summary(cli),
        "wall_s": time.monotonic() - started,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
