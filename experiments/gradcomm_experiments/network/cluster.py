"""An emulated cluster on one Linux machine: network namespaces, a bridge and shaped links.

Each host is a network namespace with one interface, `veth0`, whose peer joins a bridge
that lives in a namespace of its own. Both ends of every link are shaped with `tc`'s token
bucket filter, so a host sends and receives at most `rate` (a switch port at that speed).
netem is not available on the machines this was built on, so no delay or loss is added:
the links have the bandwidth of the shaping and the latency of the kernel.

Binding gloo to the host's interface needs no patch of JAX: gloo's TCP transport binds to
the address of this machine's hostname (127.0.0.1 here), and `ip netns exec NAME` mounts
`/etc/netns/NAME/hosts` over `/etc/hosts` (ip-netns(8)), so each namespace gets a hosts
file that maps the hostname to its own address. Checked with jax and jaxlib 0.10.2.

Everything is named with a prefix unique to this run (`gc<pid>`), and `Cluster.close`
removes exactly what this run made, whatever happened in between: use it as a context
manager. Every command needs root (CAP_NET_ADMIN); `require_root` says so in one line.

Example (as root):

    with Cluster(2, rate="100mbit") as cluster:
        print(cluster.measure_links())           # Mbit/s per host, plain TCP sockets
        cluster.run(0, ["python", "-c", "print('hi from host 0')"])
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

RATE_UNITS = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
UNSHAPED = "unshaped"
SUBNET = "10.77.{}.{}"  # a private /24 that exists only inside this run's namespaces
NETNS_ETC = pathlib.Path("/etc/netns")  # per-namespace files for `ip netns exec`


def parse_rate(rate: str) -> float | None:
    """Mbit/s of a tc rate such as '100mbit' or '1gbit'; None for 'unshaped'."""
    if rate == UNSHAPED:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", rate)
    if not match:
        raise ValueError(f"bad rate {rate!r}: use e.g. 100mbit, 1gbit or {UNSHAPED}")
    return float(match.group(1)) * RATE_UNITS[match.group(2)]


def root_problem(*, probe: bool = False) -> str | None:
    """Why namespaces cannot be made here (one line), or None when they can.

    With `probe`, also makes and removes one namespace, for containers where root lacks
    CAP_NET_ADMIN.
    """
    if os.geteuid() != 0:
        return "needs root: network namespaces, veth pairs and tc shaping need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (Debian package iproute2)"
    if probe:
        name = f"gc{os.getpid() % 100000}-probe"
        made = _sh("ip", "netns", "add", name, check=False)
        if made.returncode:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        _sh("ip", "netns", "del", name, check=False)
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


class Cluster:
    """N hosts in network namespaces joined by a bridge, each link shaped to `rate`.

    Args:
      hosts: the number of hosts (namespaces).
      rate: a tc rate ('100mbit', '1gbit') or 'unshaped'.
      subnet: the third octet of the hosts' 10.77.x.0/24 addresses.
    """

    def __init__(self, hosts: int, rate: str = UNSHAPED, *, subnet: int = 0) -> None:
        if hosts < 1:
            raise ValueError(f"hosts must be at least 1, got {hosts}")
        self.hosts, self.rate, self.mbit = hosts, rate, parse_rate(rate)
        self.prefix = f"gc{os.getpid() % 100000}"
        self.bridge_ns = f"{self.prefix}-br"
        self.namespaces = [f"{self.prefix}-h{i}" for i in range(hosts)]
        self.addresses = [SUBNET.format(subnet, i + 1) for i in range(hosts)]
        self._made: list[str] = []  # namespaces this run created, in order
        self._etc: list[pathlib.Path] = []  # /etc/netns directories this run created

    # -------------------------------------------------------------- set up, tear down

    def __enter__(self) -> Cluster:
        previous = signal.getsignal(signal.SIGTERM)
        if previous in (signal.SIG_DFL, None):  # turn SIGTERM into an exception: cleanup runs
            signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def open(self) -> None:
        """Creates the namespaces, the bridge, one veth pair per host, and the shaping."""
        problem = root_problem()
        if problem:
            raise PermissionError(problem)
        self._add_namespace(self.bridge_ns)
        br = ["ip", "-n", self.bridge_ns]
        _sh(*br, "link", "add", "br0", "type", "bridge")
        _sh(*br, "link", "set", "br0", "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            self._add_namespace(ns)
            port = f"p{i}"
            # Created inside the host namespace, the peer end is moved to the bridge's.
            _sh("ip", "-n", ns, "link", "add", "veth0", "type", "veth", "peer", "name", port)
            _sh("ip", "-n", ns, "link", "set", port, "netns", self.bridge_ns)
            _sh(*br, "link", "set", port, "master", "br0")
            _sh(*br, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "veth0")
            _sh("ip", "-n", ns, "link", "set", "veth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            self._hosts_file(ns, address)
            if self.mbit is not None:  # both directions: the host's egress and its port's
                self._shape(ns, "veth0")
                self._shape(self.bridge_ns, port)

    def _hosts_file(self, namespace: str, address: str) -> None:
        """/etc/hosts inside the namespace: this machine's hostname is the host's address."""
        directory = NETNS_ETC / namespace
        directory.mkdir(parents=True)
        self._etc.append(directory)
        name = socket.gethostname()
        (directory / "hosts").write_text(f"127.0.0.1 localhost\n{address} {name}\n")

    def _add_namespace(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._made.append(name)

    def _shape(self, namespace: str, device: str) -> None:
        # A burst of 1 ms of traffic (at least 32 KiB) keeps the average rate exact at
        # both speeds; the queue holds 100 ms so TCP sees drops, not unbounded delay.
        burst = max(32 * 1024, int(self.mbit * 1e6 / 8 / 1000))
        _sh(
            "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
            "rate", self.rate, "burst", str(burst), "latency", "100ms",
        )  # fmt: skip

    def close(self) -> None:
        """Removes every namespace this run made (their links and qdiscs go with them)."""
        while self._etc:
            shutil.rmtree(self._etc.pop(), ignore_errors=True)
        while self._made:
            name = self._made.pop()
            _sh("ip", "netns", "del", name, check=False)

    # -------------------------------------------------------------- running things

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv run inside host's namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *argv]

    def run(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), **kwargs)

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def measure_links(self, seconds: float = 1.0, port: int = 5201) -> list[float]:
        """Each host's egress in Mbit/s: host i streams to host i+1 with plain TCP sockets.

        One host at a time, for about `seconds` of data at the shaped rate (or at most
        `seconds` unshaped), so each figure is one link's own throughput.
        """
        if self.hosts < 2:
            return []
        results = []
        for i in range(self.hosts):
            j = (i + 1) % self.hosts
            server = self.popen(
                j, [sys.executable, "-c", _SINK, self.addresses[j], str(port)],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                budget = 2**31 if self.mbit is None else int(self.mbit * 1e6 / 8 * seconds)
                argv = [sys.executable, "-c", _SOURCE, self.addresses[j], str(port)]
                out = self.run(
                    i, [*argv, str(budget), str(seconds)],
                    capture_output=True, text=True, timeout=60, check=True,
                )  # fmt: skip
                results.append(float(out.stdout.strip()))
            finally:
                server.wait(timeout=30)
        return results


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# A sink that accepts one connection and reads until it closes (bounded by a timeout).
_SINK = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(30)
while c.recv(1 << 20):
    pass
"""

# A source that connects, sends up to `budget` bytes for at most `seconds` (x 4 shaped),
# waits for the sink to have read everything, and prints Mbit/s.
_SOURCE = """
import socket, sys, time
host, port, budget, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
for attempt in range(100):
    try:
        s = socket.create_connection((host, port), timeout=30); break
    except OSError:
        time.sleep(0.05)
chunk, sent = b"\\0" * (1 << 16), 0
t0 = time.perf_counter()
while sent < budget and time.perf_counter() - t0 < 4 * seconds:
    s.sendall(chunk); sent += len(chunk)
s.shutdown(socket.SHUT_WR); s.recv(1)
print(8 * sent / (time.perf_counter() - t0) / 1e6)
"""
