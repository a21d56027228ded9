"""The forwarding process: moves IP packets between the hosts' TUN devices through the
:class:`~bench.wan.emulator.Emulator`.

Started by :class:`bench.wan.Testbed` as ``python -m bench.wan.forwarder CONFIG_JSON``
with the TUN file descriptors and one end of a control socket inherited. One thread,
one epoll set: read every readable TUN device until it is empty (bounded per pass),
hand the packets to the emulator, write out whatever is due, sleep until the next
packet is due or one arrives. Reads and writes are plain non-blocking ``os.read`` /
``os.write`` on MTU-sized packets (9000 bytes by default keeps the count per byte low).

Control: newline-terminated JSON commands on the control socket, one JSON reply each:
``{"cmd": "stats"}`` (the emulator's counters), ``{"cmd": "set", "host": i, ...LinkSpec
fields}`` (change a link live). End of file on it (the testbed closed it, or died) ends
the process; so does the parent's death (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from bench.wan.emulator import Emulator, LinkSpec

# Packets read from one device per pass before the others get their turn: bounds how
# long one busy sender can hold the loop (64 x 9000 B = 576 KB, ~5 ms at 1 Gbit/s).
READ_BATCH = 64
# Largest packet a TUN device hands over (IPv4 total length is 16 bits).
MAX_PACKET = 65535
# Packets due this soon are written now: epoll sleeps in whole milliseconds, so waking
# for a packet 0.2 ms away would cost a wake-up per packet at high rates for nothing.
EARLY_S = 0.0002
# A control command longer than this is a bug in the testbed, not something to buffer.
MAX_CONTROL_LINE = 1 << 16

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _spec(raw: dict[str, Any]) -> LinkSpec:
    return LinkSpec(
        addr=bytes(raw["addr"]),
        delay_s=float(raw["delay_s"]),
        up_bytes_per_s=raw["up_bytes_per_s"],
        down_bytes_per_s=raw["down_bytes_per_s"],
        queue_s=float(raw["queue_s"]),
        loss=float(raw["loss"]),
    )


class Forwarder:
    def __init__(self, config: dict[str, Any]) -> None:
        self.names: list[str] = list(config["names"])
        self.fds: list[int] = list(config["fds"])
        self.control = socket.socket(fileno=int(config["control_fd"]))
        extra = {(int(i), int(j)): float(s) for i, j, s in config.get("extra_delay_s", [])}
        self.emulator = Emulator(
            [_spec(raw) for raw in config["links"]],
            extra_delay_s=extra,
            seed=int(config.get("seed", 0)),
        )
        self._control_buffer = b""

    def _handle(self, command: dict[str, Any]) -> dict[str, Any]:
        if command.get("cmd") == "stats":
            return {"ok": True, **self.emulator.counters.as_dict(self.names)}
        if command.get("cmd") == "set":
            host = int(command["host"])
            self.emulator.reconfigure(host, _spec(command["link"]))
            return {"ok": True}
        return {"ok": False, "error": f"unknown command {command!r}"}

    def _on_control(self) -> bool:
        """Serve control commands; False once the testbed has gone."""
        try:
            data = self.control.recv(MAX_CONTROL_LINE)
        except BlockingIOError:
            return True
        if not data:
            return False
        self._control_buffer += data
        if len(self._control_buffer) > MAX_CONTROL_LINE:
            raise RuntimeError("control line too long: a testbed bug")
        while b"\n" in self._control_buffer:
            line, self._control_buffer = self._control_buffer.split(b"\n", 1)
            try:
                reply = self._handle(json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                reply = {"ok": False, "error": repr(exc)}
            self.control.sendall(json.dumps(reply).encode() + b"\n")
        return True

    def run(self) -> None:
        emulator = self.emulator
        fds = self.fds
        poller = select.epoll()
        index = {}
        for i, fd in enumerate(fds):
            os.set_blocking(fd, False)
            poller.register(fd, select.EPOLLIN)
            index[fd] = i
        control_fd = self.control.fileno()
        self.control.setblocking(False)
        poller.register(control_fd, select.EPOLLIN)
        read = os.read
        write = os.write
        clock = time.monotonic
        receive = emulator.receive
        self.control.sendall(b'{"ready": true}\n')
        while True:
            wake = emulator.next_due()
            timeout = -1.0 if wake is None else max(0.0, wake - clock())
            for fd, _ in poller.poll(timeout):
                if fd == control_fd:
                    if not self._on_control():
                        return
                    continue
                src = index[fd]
                now = clock()
                for _ in range(READ_BATCH):
                    try:
                        packet = read(fd, MAX_PACKET)
                    except BlockingIOError:
                        break
                    receive(src, packet, now)
            for dst, packet in emulator.due(clock() + EARLY_S):
                # A device going away (the testbed tearing down) or a full kernel queue
                # loses the packet, as a real link would.
                with contextlib.suppress(OSError):
                    write(fds[dst], packet)


# The emulated network should not be what a busy machine starves first: the forwarder
# asks for a higher scheduling priority (root may; elsewhere it keeps its own).
FORWARDER_NICE = -10


def main(argv: list[str]) -> int:
    _die_with_parent()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, FORWARDER_NICE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the testbed stops us, not a Ctrl-C
    config = json.loads(argv[1])
    Forwarder(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
