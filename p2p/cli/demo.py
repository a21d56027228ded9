"""``blob demo``: the main job end to end, on three real node processes on 127.0.0.1.

1. Generate a safetensors checkpoint (numpy, fixed seed) in a temp directory.
2. Node 1 puts it into its store and serves it.
3. Node 2 fetches it from node 1, then serves it too.
4. Node 3 fetches it from nodes 1 and 2 at once.
5. Node 3's copy is verified chunk by chunk, memory-mapped from the store with
   safetensors and compared with the original tensors; a throughput table closes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click
import numpy as np

SERVE_READY_TIMEOUT = 60.0
FETCH_TIMEOUT = 600.0


def make_checkpoint(path: Path, size_mib: int, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """A llama-shaped float32 checkpoint of about ``size_mib`` MiB."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    hidden = 1024
    per_layer = 4 * hidden * hidden * 4  # q, k, v, o in float32
    layers = max(1, (size_mib * 1024 * 1024) // per_layer)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"model.layers.{layer}.self_attn.{name}.weight"] = rng.standard_normal(
                (hidden, hidden), dtype=np.float32
            )
    save_file(tensors, str(path))
    return {name: t.shape for name, t in tensors.items()}


def _blob(store: Path, key: Path, *args: str, timeout: float = FETCH_TIMEOUT) -> Any:
    cmd = [sys.executable, "-m", "p2p.cli", "--store", str(store), "--key", str(key), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(args[:2])} failed: {done.stderr.strip()}")
    result: Any = json.loads(done.stdout)
    return result


def _serve(store: Path, key: Path, stack: ExitStack) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "p2p.cli", "--store", str(store), "--key", str(key),
        "serve", "--json", "--no-dht",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stack.callback(_stop, proc)
    assert proc.stdout is not None
    deadline = time.monotonic() + SERVE_READY_TIMEOUT
    line = proc.stdout.readline()
    if not line or time.monotonic() > deadline:
        raise click.ClickException(
            f"node did not start: {proc.stderr.read() if proc.stderr else ''}"
        )
    ready: dict[str, Any] = json.loads(line)
    return ready


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def run_demo(*, size_mib: int = 256, keep: bool = False, as_json: bool = False) -> None:

    def say(message: str) -> None:
        if not as_json:
            click.echo(message, err=True)

    work = Path(tempfile.mkdtemp(prefix="blobnet-demo-"))
    rows: list[dict[str, Any]] = []
    try:
        with ExitStack() as stack:
            stores = [work / f"node{i}" / "store" for i in (1, 2, 3)]
            keys = [work / f"node{i}" / "machine.key" for i in (1, 2, 3)]
            ckpt = work / "checkpoint.safetensors"
            say(f"[demo] generating a {size_mib} MiB safetensors checkpoint in {work}")
            shapes = make_checkpoint(ckpt, size_mib)
            size = ckpt.stat().st_size

            t0 = time.monotonic()
            put = _blob(stores[0], keys[0], "put", str(ckpt), "--json")
            blob_id = put[0]["id"]
            rows.append({"step": "node1 put", "seconds": time.monotonic() - t0, "bytes": size})
            say(f"[demo] node1 put {blob_id}")

            node1 = _serve(stores[0], keys[0], stack)
            say(f"[demo] node1 serving as {node1['peer_id']}")

            t0 = time.monotonic()
            got2 = _blob(stores[1], keys[1], "get", blob_id, "--peer", node1["addrs"][0], "--json")
            rows.append(
                {
                    "step": "node2 <- node1",
                    "seconds": time.monotonic() - t0,
                    "bytes": size,
                    "transfer_seconds": got2.get("seconds"),
                    "peers": got2.get("peers", {}),
                }
            )
            node2 = _serve(stores[1], keys[1], stack)
            say(f"[demo] node2 fetched it and serves as {node2['peer_id']}")

            t0 = time.monotonic()
            got3 = _blob(
                stores[2],
                keys[2],
                "get",
                blob_id,
                "--peer",
                node1["addrs"][0],
                "--peer",
                node2["addrs"][0],
                "--json",
            )
            rows.append(
                {
                    "step": "node3 <- node1+node2",
                    "seconds": time.monotonic() - t0,
                    "bytes": size,
                    "transfer_seconds": got3.get("seconds"),
                    "peers": got3.get("peers", {}),
                }
            )
            say("[demo] node3 fetched it from both")

        verify = _blob(stores[2], keys[2], "verify", blob_id, "--json")
        summary = _mmap_summary(stores[2], blob_id, ckpt, shapes)
        verified = all(entry["ok"] for entry in verify)
        result = {"blob_id": blob_id, "size": size, "steps": rows, "verified": verified, **summary}
        if as_json:
            click.echo(json.dumps(result))
        else:
            _print_table(result)
    finally:
        if keep:
            click.echo(f"[demo] stores kept in {work}", err=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _mmap_summary(
    store_root: Path, blob_id: str, original: Path, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    from safetensors import safe_open

    from blobstore import Store

    path = Store.open(store_root).path(blob_id)
    params = 0
    identical = True
    with (
        safe_open(str(path), framework="numpy") as fetched,
        safe_open(str(original), framework="numpy") as source,
    ):
        names = sorted(fetched.keys())
        for name in names:
            tensor = fetched.get_tensor(name)
            params += int(tensor.size)
            if tuple(tensor.shape) != shapes[name] or not np.array_equal(
                tensor, source.get_tensor(name)
            ):
                identical = False
    return {
        "store_path": str(path),
        "tensors": len(names),
        "params": params,
        "identical_to_source": identical,
    }


def _print_table(result: dict[str, Any]) -> None:
    click.echo(f"blob {result['blob_id']}  ({result['size'] / 2**20:.0f} MiB)")
    click.echo(f"{'step':<24}{'wall s':>8}{'transfer s':>12}{'MB/s':>8}  MiB from each peer")
    for row in result["steps"]:
        transfer = row.get("transfer_seconds")
        rate = row["bytes"] / (transfer or row["seconds"]) / 1e6
        shown = f"{transfer:.2f}" if transfer else "-"
        peers = ", ".join(
            f"..{peer[-6:]}:{info['bytes'] / 2**20:.0f}"
            for peer, info in row.get("peers", {}).items()
        )
        click.echo(f"{row['step']:<24}{row['seconds']:>8.2f}{shown:>12}{rate:>8.1f}  {peers}")
    click.echo("(wall time includes starting a `blob` process; MB/s is over the transfer itself)")
    ok = result["identical_to_source"] and result["verified"]
    click.echo(
        f"node3 copy: {result['tensors']} tensors, {result['params'] / 1e6:.1f}M params, "
        f"memory-mapped from {result['store_path']}: "
        + ("verified, identical to the source" if ok else "MISMATCH")
    )
    if not ok:
        raise click.ClickException("the fetched checkpoint does not match its source")
