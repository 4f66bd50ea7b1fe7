"""Separate network hosts for tests: network namespaces on a private bridge of this machine.

    with NetNamespace() as ns, SshServer(netns=ns) as sshd:
        t = sshd.transport(connect_timeout=2)     # reaches ns.address (10.213.X.2) over a veth
        ns.set_link(False)                         # the host stops answering (packets are dropped)
        ns.set_link(True)                          # and comes back

    with PrivateNetwork() as net, net.namespace() as a, net.namespace() as b:
        ...                                        # a and b reach each other and us (net.gateway)

Each network is its own 10.213.X.0/24 on a bridge in this namespace (gateway .1, hosts .2, .3, ...).
Nothing forwards it anywhere, and a blackhole route for the subnet catches whatever the bridge
cannot deliver, so test traffic never leaves the machine. Processes in a namespace share our
filesystem: a host's workspace is just a temporary directory. Needs root and iproute2.
"""

import itertools
import os
import random
import shutil
import signal
import subprocess
import time

import pytest

from tests.resource import Resource

_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _tag() -> str:
    return f"{os.getpid() % 100000:x}{next(_counter):x}"


def ensure_netns_possible() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("network-namespace tests need root and iproute2 (`ip`): run them as root "
                    "(CI does), with iproute2 installed", pytrace=False)


class PrivateNetwork(Resource):
    """A bridge with its own 10.213.X.0/24; `namespace()` adds a host to it."""

    def __init__(self) -> None:
        self.bridge = f"lrb{_tag()}"[:15]
        self.subnet = ""
        self.gateway = ""
        self._hosts = itertools.count(2)

    def _prepare(self) -> None:
        ensure_netns_possible()

    def _open(self) -> None:
        used = _ip("-4", "route", "show", "table", "all").stdout + _ip("-4", "addr").stdout
        free = [x for x in random.sample(range(1, 255), 254) if f"10.213.{x}." not in used]
        if not free:
            raise RuntimeError("no free 10.213.X.0/24 subnet for a test network")
        self.subnet, self.gateway = f"10.213.{free[0]}.0/24", f"10.213.{free[0]}.1"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        _ip("route", "add", "blackhole", self.subnet, "metric", "4242")

    def next_address(self) -> str:
        return f"{self.subnet.rsplit('.', 1)[0]}.{next(self._hosts)}"

    def namespace(self) -> "NetNamespace":
        return NetNamespace(network=self)

    def close(self) -> None:
        if self.subnet:
            _ip("route", "del", "blackhole", self.subnet, "metric", "4242", check=False)
        _ip("link", "del", self.bridge, check=False)


class NetNamespace(Resource):
    """One host: a namespace joined to a PrivateNetwork (its own, unless given one) by a veth pair."""

    def __init__(self, network: PrivateNetwork | None = None) -> None:
        tag = _tag()
        self.name = f"longrun-test-{tag}"
        self.host_link = f"lrh{tag}"[:15]
        self.ns_link = f"lrn{tag}"[:15]
        self.network = network
        self._own_network = network is None
        self.address = ""

    def _prepare(self) -> None:
        ensure_netns_possible()

    def _open(self) -> None:
        if self._own_network:
            self.network = PrivateNetwork().__enter__()
        self.address = self.network.next_address()
        _ip("netns", "add", self.name)
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.ns_link)
        _ip("link", "set", self.ns_link, "netns", self.name)
        _ip("link", "set", self.host_link, "master", self.network.bridge)
        _ip("link", "set", self.host_link, "up")
        inside = ("netns", "exec", self.name, "ip")
        _ip(*inside, "addr", "add", f"{self.address}/24", "dev", self.ns_link)
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", self.ns_link, "up")

    @property
    def gateway(self) -> str:
        """Our own address as the namespace sees it (a server under test can listen there)."""
        return self.network.gateway

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def set_link(self, up: bool) -> None:
        """Cut or restore the host's only link; packets to and from it are dropped meanwhile."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_link, "up" if up else "down")

    def pids(self) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.name, check=False).stdout.split()]

    def close(self) -> None:
        """Kill what still runs in the namespace (we started all of it), then remove it and its link."""
        if self.name in _ip("netns", "list", check=False).stdout.split():
            for _ in range(50):
                pids = self.pids()
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
            _ip("netns", "del", self.name, check=False)
        _ip("link", "del", self.host_link, check=False)
        if self._own_network and self.network is not None:
            self.network.close()
