"""BlockingNode after its node thread died: the next call says so, in the network layer's
own error type, instead of surfacing a trio internal; and a program that embeds one gets
no library warnings on its stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from p2p import NodeStopped, P2PError
from p2p.node.blocking import BlockingNode, NodeNotRunning


class NodeCrash(Exception):
    pass


async def _crash() -> None:
    raise NodeCrash("simulated failure inside the node's event loop")


def test_calls_after_the_node_crashed_raise_node_stopped(tmp_path: Path) -> None:
    node = BlockingNode(tmp_path / "store", listen=["/ip4/127.0.0.1/tcp/0"], dht=False)
    with node:
        assert node.peer_id
        token = node._token
        assert token is not None and node._thread is not None
        # A system task that raises takes the whole trio run down, as a crash in the
        # swarm would.
        trio.from_thread.run_sync(trio.lowlevel.spawn_system_task, _crash, trio_token=token)
        node._thread.join(timeout=30)
        assert not node._thread.is_alive()
        with pytest.raises(NodeStopped, match="stopped") as info:
            node.connect(
                "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWD1UBHk5aaWC5rVxrVVWBPVKPHfgxR8RdtDHeSN1zFESg"
            )
        assert isinstance(info.value, P2PError)
        with pytest.raises(NodeStopped):
            _ = node.store
    # close() after the crash is quiet; a facade that was never started is a caller bug.
    with pytest.raises(NodeNotRunning):
        BlockingNode(tmp_path / "other").fetch("0" * 64)


def test_a_training_script_shares_fetches_by_tag_and_takes_one_tensor(tmp_path: Path) -> None:
    """Two nodes in one plain script: bytes added with a tag on one, fetched by ID on the
    other, then found by its local tag with no provider left to ask; one tensor of a
    safetensors blob taken without the rest of the file."""
    import numpy as np
    from safetensors.numpy import save

    from blobstore import BlobNotFound

    rng = np.random.default_rng(1)
    tensors = {f"w{i}": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(4)}
    checkpoint = save(tensors)  # four 1 MiB tensors: five 1 MiB chunks
    listen = ["/ip4/127.0.0.1/tcp/0"]
    with BlockingNode(tmp_path / "a", listen=listen, dht=False) as a:
        note_id = a.add_bytes(b"step 1000 done", tag="note")
        ckpt_id = a.add_bytes(checkpoint)
        assert a.store.resolve("note") == note_id
        with BlockingNode(tmp_path / "b", listen=listen, dht=False) as b:
            assert b.fetch(note_id, providers=a.addrs) == note_id
            b.store.tag("latest-note", note_id)
            w2 = b.fetch_tensor(ckpt_id, "w2", providers=a.addrs)
            assert np.array_equal(w2, tensors["w2"])
            assert not b.store.has(ckpt_id)  # only w2's chunks (and the header's) came
            held = b.store.chunk_bitmap(ckpt_id)
            assert 0 < sum(bin(byte).count("1") for byte in held) < 5
    with BlockingNode(tmp_path / "b", listen=listen, dht=False) as b:
        # Provider gone: a local tag still resolves, to the blob already here.
        assert b.fetch("latest-note") == note_id
        assert b.store.path(note_id).read_bytes() == b"step 1000 done"
        with pytest.raises(BlobNotFound):
            b.fetch("no-such-tag")


# A program that embeds a node, as the README's BlockingNode example does: it configures
# no logging of its own.
_EMBEDDING_SCRIPT = """
import sys
from identity import MachineKey
from p2p import BlockingNode

nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{MachineKey.generate().peer_id}"
with BlockingNode(sys.argv[1], listen=["/ip4/127.0.0.1/tcp/0"], dht=False) as node:
    try:
        node.fetch("0" * 64, providers=[nobody])
    except Exception as exc:
        print(type(exc).__name__)
"""


def test_an_embedding_program_gets_no_library_warnings(tmp_path: Path) -> None:
    """py-libp2p's warnings (a failed dial, a DHT peer in its negative cache) reached the
    stderr of every program that embeds a node, 17-33 lines for the README's example,
    through Python's last-resort handler: the error it raised is the whole story."""
    done = subprocess.run(
        [sys.executable, "-c", _EMBEDDING_SCRIPT, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() in ("NoProviders", "PeerUnreachable"), done.stderr
    assert done.stderr == ""


def test_no_provider_names_the_named_provider_it_could_not_reach(tmp_path: Path) -> None:
    """Two providers named: one reached that does not hold the blob, one not reached. The
    error says both, since the one not reached may be the one that holds it."""
    from identity import MachineKey
    from p2p import NoProviders

    listen = ["/ip4/127.0.0.1/tcp/0"]
    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{MachineKey.generate().peer_id}"  # discard: closed
    with (
        BlockingNode(tmp_path / "a", listen=listen, dht=False) as a,
        BlockingNode(tmp_path / "b", listen=listen, dht=False) as b,
        pytest.raises(NoProviders) as caught,
    ):
        b.fetch("0" * 64, providers=[*a.addrs, nobody])
    message = str(caught.value)
    assert message.startswith("none of 1 peer(s) asked holds " + "0" * 64), message
    assert "; not reached: " in message and "tcp/9" in message, message
