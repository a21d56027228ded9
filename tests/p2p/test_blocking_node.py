"""BlockingNode after its node thread died: the next call says so, in the network layer's
own error type, instead of surfacing a trio internal."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from p2p import NodeStopped, P2PError
from p2p.blocking import BlockingNode, NodeNotRunning


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
