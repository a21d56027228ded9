"""An emulated WAN for tests and benchmarks: one network namespace per host, a TUN device
in each, one user-space forwarder applying per-host delay, rates, drop-tail queues and
loss; kernel TCP unchanged. See :mod:`bench.wan.testbed` (lifecycle) and
:mod:`bench.wan.emulator` (the link model)."""

from bench.wan.testbed import (
    PREFIX,
    STOCK_TCP_RMEM,
    STOCK_TCP_WMEM,
    SUBNET,
    THREE_CONTINENTS,
    Host,
    Testbed,
    TestbedError,
    TestbedUnavailable,
    list_namespaces,
    sweep,
    three_continents,
    unavailable_reason,
)

__all__ = [
    "PREFIX",
    "STOCK_TCP_RMEM",
    "STOCK_TCP_WMEM",
    "SUBNET",
    "THREE_CONTINENTS",
    "Host",
    "Testbed",
    "TestbedError",
    "TestbedUnavailable",
    "list_namespaces",
    "sweep",
    "three_continents",
    "unavailable_reason",
]
