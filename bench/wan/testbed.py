"""An emulated WAN on one Linux machine: network namespaces, TUN devices and one
user-space forwarder (this kernel has no netem).

Theory of operation
===================

1. Each host is a network namespace named ``<prefix><pid>-<n>-<host>`` (the creating
   process's id and a per-process counter: parallel testbeds never collide, and a
   sweep can tell a dead owner's leftovers from a live one's). Inside: loopback up, one
   TUN device ``wan0`` with the host's address in a private /24 (``SUBNET``), the given
   MTU, IPv6 off, and the TCP buffer limits set explicitly (stock Linux by default:
   ``tcp_wmem`` max 4 MiB, ``tcp_rmem`` max 6 MiB), so results do not depend on how
   the machine running them is tuned. The root namespace gets no address and no route:
   the /24 exists only inside the testbed's namespaces, and no packet leaves them.
2. The TUN devices are created here, in the root namespace, then moved into their
   namespaces; their file descriptors go to one forwarding process
   (``bench.wan.forwarder``), which applies each host's delay, rates, drop-tail queues
   and loss (``bench.wan.emulator``). Kernel TCP runs unchanged at both ends.
3. A non-persistent TUN device lives as long as a descriptor on it: when the forwarder
   exits, the devices go, whatever killed it. The forwarder dies with its parent
   (PR_SET_PDEATHSIG) and when the control socket closes.
4. Teardown (``close``: on leaving the ``with`` block, normally or by an exception, on
   SIGTERM while the testbed is open in the main thread, and at interpreter exit) kills
   the processes started through the testbed, then every process still inside its
   namespaces, stops the forwarder and deletes the namespaces. Each step is attempted
   even when an earlier one failed. A process killed with SIGKILL cannot clean up: the
   next testbed's start (or :func:`sweep`) deletes namespaces whose owner is dead.
5. A NATed host (``Host(nat=...)``) has a second namespace, its router
   (``...-<host>-nat``), which holds the TUN device and the host's public address; the
   host reaches it over a veth pair on its own /24 (``10.77.<100 + index>.0/24``) with a
   default route through it. The router forwards, masquerades what leaves on ``wan0``
   (nftables; ``NAT_KINDS``) and turns away unsolicited inbound packets as
   ``Host.nat_inbound`` says (``NAT_INBOUND``: silently, with a TCP reset, or with an
   ICMP port unreachable). The forwarder sees only the router, so the host's link
   settings apply to the router's link.
6. Carrier-grade NAT (``Host(nat_layers=2)``): a third namespace (``...-<host>-cgn``)
   holds the TUN device and the public address; the home router's ``wan0`` is then a
   veth to it on ``100.64.<index>.0/24`` (RFC 6598's shared address space, inside the
   testbed only). The carrier's router masquerades and filters as the home router does.
7. ``Host.nat_idle_s`` sets the routers' conntrack timeouts for established TCP and for
   UDP (per namespace): a mapping idle that long is forgotten, and the next inbound
   packet of the flow is unsolicited.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

PREFIX = "blobwan-"
# Private addresses used only inside the testbed's namespaces (never in the root one).
SUBNET = ipaddress.IPv4Network("10.77.0.0/24")
FIRST_HOST = 10  # hosts get .10, .11, ...
MAX_HOSTS = 200  # .10 to .209: stays inside the /24
DEFAULT_MTU = 9000
# Stock Linux limits (min, default, max): what an untuned host gives one connection.
STOCK_TCP_WMEM = (4096, 16384, 4 * 1024 * 1024)
STOCK_TCP_RMEM = (4096, 131072, 6 * 1024 * 1024)
DEVICE = "wan0"
LAN_DEVICE = "lan0"
# A NATed host's LAN: 10.77.<100 + host index>.0/24, the router .1, the host .2; like the
# WAN it exists only inside the testbed's namespaces.
LAN_BASE = 100
# nftables masquerade on the router's WAN side. "eim": endpoint-independent mapping (the
# kernel keeps the source port where it can, so one socket maps to one public port
# whatever it talks to: hole punching works). "symmetric": every connection gets a fresh
# random port (endpoint-dependent: the port a peer saw is useless to a third party).
NAT_KINDS = {"eim": "masquerade", "symmetric": "masquerade fully-random"}
# What a router does with an unsolicited inbound packet (conntrack state new, or invalid:
# a SYN that meets a mapping its own side just saw reset), as routers in the field do.
# "drop": nothing (many home routers). "reset": a TCP SYN is answered with a TCP reset and
# other packets with ICMP port unreachable (OpenWrt's default REJECT on its WAN zone, and
# host firewalls). "icmp": ICMP port unreachable for a TCP SYN and for UDP. Other TCP
# segments without a mapping are dropped by all three.
NAT_INBOUND = {
    "drop": ("drop", "drop"),
    "reset": ("reject with tcp reset", "reject with icmp type port-unreachable"),
    "icmp": (
        "reject with icmp type port-unreachable",
        "reject with icmp type port-unreachable",
    ),
}
# Stacked NAT routers behind one host: 1 (a home router) or 2 (a home router behind a
# carrier-grade NAT).
MAX_NAT_LAYERS = 2
# The carrier's inside network for host i: 100.64.<i>.0/24 (RFC 6598), router .1, home .2.
CGN_NET = "100.64"
# The conntrack timeouts a router's idle expiry (Host.nat_idle_s) sets.
IDLE_SYSCTLS = (
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_udp_timeout",
    "net.netfilter.nf_conntrack_udp_timeout_stream",
)
TUN_PATH = "/dev/net/tun"

# Seconds: how long setup steps and teardown may take before we call them stuck.
IP_TIMEOUT = 20.0
FORWARDER_READY_TIMEOUT = 20.0
CONTROL_TIMEOUT = 10.0
STOP_GRACE = 5.0

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,11}")
_NETNS_NAME = re.compile(r"(?P<pid>\d+)-(?P<n>\d+)-(?P<host>[a-z][a-z0-9]*)(-nat|-cgn)?")
_REPO_ROOT = Path(__file__).resolve().parents[2]
_counter = itertools.count()


class TestbedUnavailable(RuntimeError):
    """This machine cannot run the testbed (not root, no `ip`, no /dev/net/tun)."""

    __test__ = False  # not a pytest test class, whatever its name


class TestbedError(RuntimeError):
    """Setting up or driving the testbed failed (a bug or a broken machine)."""

    __test__ = False


@dataclass(frozen=True)
class Host:
    """One host's access link. Rates in Mbit/s (None: unshaped); delay one way, host to
    the core, so RTT(i, j) = 2 (delay_i + delay_j); the drop-tail queue holds
    ``queue_ms`` of the link's rate; ``loss`` (None: the testbed's) applies to packets
    this host sends."""

    delay_ms: float = 0.0
    up_mbit: float | None = 1000.0
    down_mbit: float | None = 1000.0
    queue_ms: float = 50.0
    loss: float | None = None
    nat: str | None = None  # None (a public address), or one of NAT_KINDS
    nat_inbound: str = "drop"  # one of NAT_INBOUND: how the routers turn away a stranger
    nat_layers: int = 1  # 2: behind a carrier-grade NAT as well (rule 6)
    nat_idle_s: int | None = None  # mappings idle this long are forgotten (None: Linux's)

    def __post_init__(self) -> None:
        if self.nat is not None and self.nat not in NAT_KINDS:
            raise ValueError(f"nat must be one of {sorted(NAT_KINDS)} or None, not {self.nat!r}")
        if self.nat_inbound not in NAT_INBOUND:
            raise ValueError(
                f"nat_inbound must be one of {sorted(NAT_INBOUND)}, not {self.nat_inbound!r}"
            )
        if not 1 <= self.nat_layers <= MAX_NAT_LAYERS:
            raise ValueError(f"nat_layers must be 1 to {MAX_NAT_LAYERS}, not {self.nat_layers}")
        if self.nat_idle_s is not None and self.nat_idle_s < 1:
            raise ValueError(f"nat_idle_s must be at least 1 s, not {self.nat_idle_s}")


def _solve_three(rtt_ab: float, rtt_bc: float, rtt_ac: float) -> tuple[float, float, float]:
    """One-way delays (a, b, c) giving the three RTTs exactly with per-host delays."""
    total = (rtt_ab + rtt_bc + rtt_ac) / 4  # = d_a + d_b + d_c
    return total - rtt_bc / 2, total - rtt_ac / 2, total - rtt_ab / 2


def three_continents(
    *, mbit: float = 1000.0, rtt_eu_us: float = 80.0, rtt_us_asia: float = 150.0,
    rtt_eu_asia: float = 200.0, queue_ms: float = 50.0,
) -> dict[str, Host]:  # fmt: skip
    """eu, us, asia with the given RTTs (ms) and access rates. The three RTTs are met
    exactly by per-host delays whenever each is at most the sum of the other two."""
    eu, us, asia = _solve_three(rtt_eu_us, rtt_us_asia, rtt_eu_asia)
    if min(eu, us, asia) < 0:
        raise ValueError("these RTTs need per-pair delays: use Testbed(extra_delay_ms=...)")
    return {
        name: Host(delay_ms=d, up_mbit=mbit, down_mbit=mbit, queue_ms=queue_ms)
        for name, d in (("eu", eu), ("us", us), ("asia", asia))
    }


# eu-us 80 ms, us-asia 150 ms, eu-asia 200 ms RTT; 1 Gbit/s each (delays 32.5, 7.5, 67.5).
THREE_CONTINENTS: Mapping[str, Host] = three_continents()


@functools.cache
def unavailable_reason() -> str | None:
    """Why this machine cannot run a testbed, or None if it can (checked once: root,
    `ip`, /dev/net/tun, and that a network namespace can really be made, which a
    container without CAP_SYS_ADMIN refuses even to root)."""
    if not sys.platform.startswith("linux"):
        return "the WAN testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the WAN testbed needs root (network namespaces, TUN devices)"
    if shutil.which("ip") is None:
        return "the WAN testbed needs the `ip` command (iproute2)"
    if not os.path.exists(TUN_PATH):
        return f"the WAN testbed needs {TUN_PATH}"
    try:
        fd = os.open(TUN_PATH, os.O_RDWR)
    except OSError as exc:
        return f"cannot open {TUN_PATH}: {exc.strerror}"
    os.close(fd)
    probe = f"{PREFIX}{os.getpid()}-{next(_counter)}-probe"
    try:
        made = subprocess.run(
            ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=IP_TIMEOUT
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip netns add`: {exc}"
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=False
    )
    if check and done.returncode != 0:
        raise TestbedError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces that start with ``prefix``."""
    out = _ip("netns", "list").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [name for name in names if name.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str) -> None:
    done = _ip("netns", "pids", netns, check=False)
    for word in done.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError):
            os.kill(int(word), signal.SIGKILL)


def _delete_namespace(netns: str) -> None:
    _kill_namespace_processes(netns)
    _ip("netns", "del", netns, check=False)


def sweep(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces left by testbeds whose process is dead; returns their names."""
    removed = []
    for name in list_namespaces(prefix):
        match = _NETNS_NAME.fullmatch(name[len(prefix) :])
        if match is None or _pid_alive(int(match["pid"])):
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


def _open_tun() -> tuple[int, str]:
    """A new non-persistent TUN device (kernel-chosen name) and its descriptor."""
    fd = os.open(TUN_PATH, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifr = fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", b"bwan%d", _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd, ifr[:16].rstrip(b"\0").decode()


def _mbit(rate: float | None) -> float | None:
    return None if rate is None else rate * 1e6 / 8


class Testbed:
    """Hosts in network namespaces joined by an emulated WAN. Use as a context manager::

        with Testbed(THREE_CONTINENTS) as tb:
            tb.run("eu", ["ping", "-c1", tb.addr("asia")])

    ``extra_delay_ms`` adds one-way delay per ordered pair of hosts, for RTTs per-host
    delays cannot give. Processes started with :meth:`popen` are killed at teardown.
    """

    __test__ = False  # not a pytest test class, whatever its name

    def __init__(
        self,
        hosts: Mapping[str, Host],
        *,
        loss: float = 0.0,
        extra_delay_ms: Mapping[tuple[str, str], float] | None = None,
        mtu: int = DEFAULT_MTU,
        tcp_wmem: tuple[int, int, int] = STOCK_TCP_WMEM,
        tcp_rmem: tuple[int, int, int] = STOCK_TCP_RMEM,
        seed: int = 0,
        prefix: str = PREFIX,
    ) -> None:
        if not hosts or len(hosts) > MAX_HOSTS:
            raise ValueError(f"a testbed has 1 to {MAX_HOSTS} hosts")
        for name in hosts:
            if not _HOST_NAME.fullmatch(name):
                raise ValueError(f"host name {name!r}: use 1-12 of [a-z0-9], starting a-z")
        if not 68 <= mtu <= 65535:
            raise ValueError(f"bad MTU {mtu}")
        self.hosts: dict[str, Host] = dict(hosts)
        self.loss = loss
        self._names = list(hosts)
        self._extra = {
            (self._names.index(a), self._names.index(b)): ms / 1000
            for (a, b), ms in (extra_delay_ms or {}).items()
        }
        self.mtu = mtu
        self.tcp_wmem = tcp_wmem
        self.tcp_rmem = tcp_rmem
        self.seed = seed
        self.prefix = prefix
        tag = f"{os.getpid()}-{next(_counter)}"
        self._netns = {name: f"{prefix}{tag}-{name}" for name in hosts}
        # The address each host's TUN device has on the WAN: a NATed host's router's.
        self._public = {
            name: str(SUBNET.network_address + FIRST_HOST + i) for i, name in enumerate(hosts)
        }
        self._addrs = dict(self._public)
        for i, (name, host) in enumerate(hosts.items()):
            if host.nat is not None:
                if shutil.which("nft") is None:
                    raise TestbedUnavailable("NAT hosts need the `nft` command (nftables)")
                self._addrs[name] = f"10.77.{LAN_BASE + i}.2"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._forwarder: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._control_lock = threading.Lock()
        self._control_buffer = b""
        self._old_sigterm: Any = None
        self._closed = False

    # ------------------------------------------------------------------ addresses
    def addr(self, host: str) -> str:
        """The host's own IPv4 address (inside the testbed only); for a NATed host a
        private one that no other host can reach."""
        return self._addrs[host]

    def public_addr(self, host: str) -> str:
        """The address other hosts see this host's packets come from (its router's if
        it is NATed, else its own)."""
        return self._public[host]

    def router_netns(self, host: str) -> str | None:
        """The namespace of a NATed host's (home) router (None for a public host)."""
        return None if self.hosts[host].nat is None else self._netns[host] + "-nat"

    def carrier_netns(self, host: str) -> str | None:
        """The namespace of a host's carrier-grade NAT (None unless ``nat_layers`` is 2)."""
        spec = self.hosts[host]
        return self._netns[host] + "-cgn" if spec.nat is not None and spec.nat_layers > 1 else None

    def routers(self, host: str) -> list[str]:
        """The namespaces of a host's routers, nearest first (none for a public host)."""
        return [ns for ns in (self.router_netns(host), self.carrier_netns(host)) if ns]

    def netns(self, host: str) -> str:
        """The host's network namespace name (for ``ip netns exec``)."""
        return self._netns[host]

    def rtt_ms(self, a: str, b: str) -> float:
        """The configured round-trip propagation delay between two hosts, in ms."""
        i, j = self._names.index(a), self._names.index(b)
        ha, hb = self.hosts[a], self.hosts[b]
        extra = self._extra.get((i, j), 0.0) + self._extra.get((j, i), 0.0)
        return 2 * (ha.delay_ms + hb.delay_ms) + extra * 1000

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise TestbedUnavailable(reason)
        sweep(self.prefix)
        atexit.register(self.close)
        self._catch_sigterm()
        fds: list[int] = []
        try:
            for name in self._names:
                fd, device = _open_tun()
                fds.append(fd)
                self._setup_host(name, device)
            self._start_forwarder(fds)
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)

    def _setup_host(self, name: str, device: str) -> None:
        netns = self._netns[name]
        self._add_namespace(netns, tcp=True)
        _ip("-n", netns, "link", "set", "lo", "up")
        wan_side = netns
        inside = netns
        for router in self.routers(name):
            self._add_namespace(router, tcp=False)
            _ip("-n", router, "link", "set", "lo", "up")
            self._setup_lan(name, inside, router)
            inside = wan_side = router
        _ip("link", "set", device, "netns", wan_side)
        _ip("-n", wan_side, "link", "set", device, "name", DEVICE)
        cidr = f"{self._public[name]}/{SUBNET.prefixlen}"
        _ip("-n", wan_side, "addr", "add", cidr, "dev", DEVICE)
        _ip("-n", wan_side, "link", "set", DEVICE, "mtu", str(self.mtu), "txqueuelen", "1000", "up")

    def _add_namespace(self, netns: str, *, tcp: bool) -> None:
        _ip("netns", "add", netns)
        self._created.append(netns)
        settings = ["net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"]
        if tcp:
            wmem = " ".join(map(str, self.tcp_wmem))
            rmem = " ".join(map(str, self.tcp_rmem))
            settings += [f"net.ipv4.tcp_wmem={wmem}", f"net.ipv4.tcp_rmem={rmem}"]
        else:  # a router: forwards, terminates nothing
            settings += ["net.ipv4.ip_forward=1"]
        self._netns_run(netns, ["sysctl", "-q", "-w", *settings])

    def _netns_run(self, netns: str, argv: list[str], stdin: str | None = None) -> None:
        done = subprocess.run(
            ["ip", "netns", "exec", netns, *argv],
            input=stdin, capture_output=True, text=True, timeout=IP_TIMEOUT, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise TestbedError(f"{argv[0]} in {netns}: {done.stderr.strip()}")

    def _setup_lan(self, name: str, inside: str, router: str) -> None:
        """A veth pair from ``inside`` (the host, or the home router in front of a carrier's
        NAT) to ``router``, a default route through it, and the router's masquerade and
        inbound filter. The home router's side is its LAN (``lan0``), or, towards a
        carrier's NAT, its ``wan0``."""
        host = self.hosts[name]
        assert host.nat is not None
        if router == self.carrier_netns(name):
            net, inner_device = f"{CGN_NET}.{self._names.index(name)}", DEVICE
        else:
            net, inner_device = self._addrs[name].rsplit(".", 1)[0], LAN_DEVICE
        _ip("-n", router, "link", "add", LAN_DEVICE, "type", "veth", "peer", "name",
            inner_device, "netns", inside)  # fmt: skip
        for ns, dev, addr in (
            (router, LAN_DEVICE, f"{net}.1/24"),
            (inside, inner_device, f"{net}.2/24"),
        ):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "mtu", str(self.mtu), "up")
        _ip("-n", inside, "route", "add", "default", "via", f"{net}.1")
        syn, other = NAT_INBOUND[host.nat_inbound]
        stranger = f"""
                    iifname "{DEVICE}" ct state new,invalid tcp flags & (syn | ack) == syn {syn}
                    iifname "{DEVICE}" ct state new meta l4proto udp {other}
                    iifname "{DEVICE}" ct state new,invalid drop"""
        ruleset = f"""
            table ip blobwan_nat {{
                chain postrouting {{
                    type nat hook postrouting priority srcnat; policy accept;
                    oifname "{DEVICE}" {NAT_KINDS[host.nat]}
                }}
                chain forward {{
                    type filter hook forward priority filter; policy accept;{stranger}
                }}
                chain input {{
                    type filter hook input priority filter; policy accept;{stranger}
                }}
            }}
        """
        self._netns_run(router, ["nft", "-f", "-"], stdin=ruleset)
        if host.nat_idle_s is not None:
            settings = [f"{key}={host.nat_idle_s}" for key in IDLE_SYSCTLS]
            self._netns_run(router, ["sysctl", "-q", "-w", *settings])

    def _link_config(self, name: str) -> dict[str, Any]:
        host = self.hosts[name]
        return {
            "addr": list(ipaddress.IPv4Address(self._public[name]).packed),
            "delay_s": host.delay_ms / 1000,
            "up_bytes_per_s": _mbit(host.up_mbit),
            "down_bytes_per_s": _mbit(host.down_mbit),
            "queue_s": host.queue_ms / 1000,
            "loss": self.loss if host.loss is None else host.loss,
        }

    def _start_forwarder(self, fds: list[int]) -> None:
        ours, theirs = socket.socketpair()
        config = {
            "names": self._names,
            "fds": fds,
            "control_fd": theirs.fileno(),
            "links": [self._link_config(name) for name in self._names],
            "extra_delay_s": [[i, j, s] for (i, j), s in self._extra.items()],
            "seed": self.seed,
        }
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        self._forwarder = subprocess.Popen(
            [sys.executable, "-m", "bench.wan.forwarder", json.dumps(config)],
            pass_fds=(*fds, theirs.fileno()),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self._control = ours
        ours.settimeout(FORWARDER_READY_TIMEOUT)
        try:
            ready = self._read_reply()
        except (TimeoutError, TestbedError) as exc:
            raise TestbedError(f"the forwarder did not start: {exc}") from None
        if not ready.get("ready"):
            raise TestbedError(f"the forwarder did not start: {ready}")
        ours.settimeout(CONTROL_TIMEOUT)

    def _read_reply(self) -> dict[str, Any]:
        assert self._control is not None
        while b"\n" not in self._control_buffer:
            data = self._control.recv(65536)
            if not data:
                raise TestbedError("the forwarder exited")
            self._control_buffer += data
        line, self._control_buffer = self._control_buffer.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def _command(self, command: dict[str, Any]) -> dict[str, Any]:
        if self._control is None or self._closed:
            raise TestbedError("the testbed is not running")
        with self._control_lock:
            self._control.sendall(json.dumps(command).encode() + b"\n")
            reply = self._read_reply()
        if not reply.get("ok"):
            raise TestbedError(f"forwarder refused {command}: {reply.get('error')}")
        return reply

    def _catch_sigterm(self) -> None:
        """SIGTERM unwinds the stack (so ``with`` blocks clean up) instead of killing us;
        only when nobody else handles it and we are in the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)

        self._old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def close(self) -> None:
        """Tear everything down (idempotent); see rule 4 of the module docstring."""
        if self._closed:
            return
        self._closed = True
        # A second Ctrl-C, SIGTERM or pytest-timeout's SIGALRM arriving mid-teardown
        # would otherwise raise out of it and leave namespaces behind; they are held
        # until every step has run (each bounded by STOP_GRACE or IP_TIMEOUT), then
        # delivered.
        main = threading.current_thread() is threading.main_thread()
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGALRM}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held) if main else None
        # The mask holds signals only for this thread: one sent to the process may land on
        # another thread (pytest's, trio's workers), and Python then runs its handler here.
        # So the handlers also just record what came, and it is delivered after teardown.
        arrived: list[int] = []
        handlers: dict[int, Any] = {}
        if main:
            for signum in held:
                handlers[signum] = signal.signal(signum, lambda n, _f: arrived.append(n))
        try:
            steps: list[Callable[[], object]] = [
                functools.partial(atexit.unregister, self.close),
                functools.partial(stop_processes, self._procs),
            ]
            steps += [functools.partial(_kill_namespace_processes, ns) for ns in self._created]
            if self._control is not None:
                steps.append(self._control.close)
            if self._forwarder is not None:
                steps.append(functools.partial(stop_process, self._forwarder))
            steps += [functools.partial(_ip, "netns", "del", n, check=False) for n in self._created]
            for step in steps:
                try:
                    step()
                except Exception as exc:  # each step is attempted whatever the last did
                    print(f"wan testbed: teardown step failed: {exc}", file=sys.stderr)
            if self._old_sigterm is not None and main:
                handlers[signal.SIGTERM] = self._old_sigterm
                self._old_sigterm = None
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for signum in dict.fromkeys(arrived):
                signal.raise_signal(signum)

    # ------------------------------------------------------------------ processes
    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside the host's namespace."""
        return ["ip", "netns", "exec", self._netns[host], *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process in the host's namespace (killed at teardown if still alive)."""
        if self._closed:
            raise TestbedError("the testbed is closed")
        proc: subprocess.Popen[Any] = subprocess.Popen(self.argv(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], *, timeout: float, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run a process in the host's namespace to completion (``subprocess.run``)."""
        return subprocess.run(self.argv(host, argv), timeout=timeout, **kwargs)

    # ------------------------------------------------------------------ the links
    def stats(self) -> dict[str, Any]:
        """The forwarder's counters: per host sent/delivered packets and bytes, random
        losses, uplink and downlink queue drops; packets it could not route."""
        return self._command({"cmd": "stats"})

    def set_host(self, host: str, **changes: Any) -> None:
        """Change a host's link while the testbed runs (``Host`` field names)."""
        self.hosts[host] = replace(self.hosts[host], **changes)
        self._command(
            {"cmd": "set", "host": self._names.index(host), "link": self._link_config(host)}
        )


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Terminate (then kill) a process and close the pipes we hold to it."""
    stop_processes([proc])


def stop_processes(procs: Sequence[subprocess.Popen[Any]]) -> None:
    """SIGTERM to all at once, SIGKILL to those still alive ``STOP_GRACE`` s later;
    then close the pipes we hold to them."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
    deadline = time.monotonic() + STOP_GRACE
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
