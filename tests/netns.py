"""A separate network host for tests: a network namespace joined to this one by a veth pair.

    with NetNamespace() as ns, SshServer(netns=ns) as sshd:
        t = sshd.transport(connect_timeout=2)     # reaches ns.address (10.213.X.2) over the veth
        ns.set_link(False)                         # the host stops answering (packets are dropped)
        ns.set_link(True)                          # and comes back

Each namespace gets its own 10.213.X.0/24 (here .1, the namespace .2); no route other than that
one is added, so test traffic never leaves the machine. Processes in the namespace share our
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

_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def ensure_netns_possible() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.fail("network-namespace tests need root and iproute2 (`ip`): run them as root "
                    "(CI does), with iproute2 installed", pytrace=False)


def _free_subnet() -> int:
    used = _ip("-4", "route", "show", "table", "all").stdout + _ip("-4", "addr").stdout
    for _ in range(200):
        x = random.randint(1, 254)
        if f"10.213.{x}." not in used:
            return x
    raise RuntimeError("no free 10.213.X.0/24 subnet for a test namespace")


class NetNamespace:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000:x}{next(_counter):x}"
        self.name = f"longrun-test-{tag}"
        self.host_link = f"lrh{tag}"[:15]
        self.ns_link = f"lrn{tag}"[:15]
        self.subnet = None
        self.address = ""
        self.host_address = ""

    def __enter__(self) -> "NetNamespace":
        ensure_netns_possible()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        x = _free_subnet()
        self.subnet = f"10.213.{x}.0/24"
        self.host_address, self.address = f"10.213.{x}.1", f"10.213.{x}.2"
        _ip("netns", "add", self.name)
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.ns_link)
        _ip("link", "set", self.ns_link, "netns", self.name)
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        _ip("netns", "exec", self.name, "ip", "addr", "add", f"{self.address}/24", "dev", self.ns_link)
        _ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
        _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_link, "up")

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def set_link(self, up: bool) -> None:
        """Cut or restore the namespace's only link.

        The namespace's end goes down, ours stays up: our route to the subnet stays, so packets for
        the namespace are dropped at the veth instead of following the default route off the machine.
        """
        _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_link, "up" if up else "down")

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        """Kill what still runs in the namespace (we started all of it), then remove it and its link."""
        if _ip("netns", "list", check=False).stdout.split().count(self.name):
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
