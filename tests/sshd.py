"""A real OpenSSH server for tests: temporary host and client keys, a random port, no system config.

    with SshServer() as sshd:                     # listens on 127.0.0.1
        t = sshd.transport(connect_timeout=3)     # an SSHTransport that trusts sshd.host_key_line
        sshd.stop()                               # listener and every open connection gone
        sshd.start()                              # back on the same port, same keys

`sshd.host_fields` is what a host registration needs (address, port, username, key_path, host_key).
`SshServer(netns=ns)` runs it inside a tests.netns.NetNamespace, listening on the namespace address
(`ns_loopback=True`: on the namespace's own 127.0.0.1, which only processes inside it reach: a host behind a bastion).
`SshServer(env={...})` sets those variables in every session (sshd's SetEnv: PATH included), as a host's own
environment would be.
"""

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.resource import Resource

SSHD = "/usr/sbin/sshd"
INSTALL_HINT = "install openssh-server (apt-get install openssh-server) to run the SSH tests"


def apt_install(packages: list[str], hint: str) -> None:
    """Install Debian packages when we are root; fail the test clearly otherwise, or when apt fails."""
    if os.geteuid() != 0:
        pytest.fail(f"{' and '.join(packages)} not installed: {hint}", pytrace=False)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=300", "--no-install-recommends", *packages]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=300"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"could not install {' and '.join(packages)}: {done.stderr.strip()[-2000:]}\n{hint}",
                        pytrace=False)


def ensure_sshd_installed() -> None:
    """Install openssh-server when it is missing and we are root; fail clearly otherwise."""
    if os.path.exists(SSHD) and shutil.which("ssh-keygen"):
        return
    apt_install(["openssh-server"], INSTALL_HINT)
    if not os.path.exists(SSHD):
        pytest.fail(f"{SSHD} still missing after installing openssh-server: {INSTALL_HINT}", pytrace=False)


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # the parent pid follows the command name, which may itself hold spaces or parentheses
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)


class SshServer(Resource):
    def __init__(self, listen: str = "127.0.0.1", port: int | None = None, netns: Any = None,
                 username: str | None = None, env: dict[str, str] | None = None, extra_config: str = "",
                 ns_loopback: bool = False):
        self.netns = netns
        self.env = env or {}
        # more sshd_config lines (SetEnv: what a login node's profile would set)
        self.extra_config = extra_config
        self.address = netns.address if netns is not None and not ns_loopback else listen
        self.port = port
        self.username = username or getpass.getuser()
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None

    # lifecycle

    def _prepare(self) -> None:
        ensure_sshd_installed()
        self.dir = Path(tempfile.mkdtemp(prefix="longrun-sshd-"))

    def _open(self) -> None:
        self._configure()
        self.start()

    def close(self) -> None:
        self.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def _configure(self) -> None:
        d = self.dir
        _keygen(d / "host_ed25519", "longrun-test-host")
        _keygen(d / "client_ed25519", "longrun-test-client")
        shutil.copy(d / "client_ed25519.pub", d / "authorized_keys")
        if self.port is None:
            # inside a namespace every port is free; outside, ask the kernel for one
            self.port = 2222 if self.netns is not None else free_port(self.address)
        (d / "sshd_config").write_text(f"""\
ListenAddress {self.address}:{self.port}
HostKey {d / 'host_ed25519'}
PidFile {d / 'sshd.pid'}
AuthorizedKeysFile {d / 'authorized_keys'}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
UseDNS no
PrintMotd no
AllowUsers {self.username}
ClientAliveInterval 5
ClientAliveCountMax 3
MaxStartups 100
LogLevel VERBOSE
Subsystem sftp internal-sftp
{self.extra_config}
""" + self._setenv_line())
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)

    def _setenv_line(self) -> str:
        # sshd keeps only its first SetEnv line: every variable goes on that one
        if not self.env:
            return ""
        return "SetEnv " + " ".join(f'"{name}={value}"' for name, value in self.env.items()) + "\n"

    def start(self) -> None:
        """Start the listener (again) on the same address, port and keys; return once it accepts."""
        if self.proc is not None and self.proc.poll() is None:
            return
        command = [SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config")]
        if self.netns is not None:
            command = self.netns.command(command)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         start_new_session=True)
        self.wait_ready()

    def stop(self, sessions: bool = True) -> None:
        """Stop the listener and, unless told otherwise, cut every connection it accepted.

        Each accepted connection is served by a child of the listener that leads its own process
        group (the user's commands run in sessions of their own and are left alone).
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        groups = children_of(proc.pid) if sessions else []
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def wait_ready(self, timeout: float = 10) -> None:
        """Return once our sshd itself listens on the port (not some other process that holds it)."""
        deadline = time.monotonic() + timeout
        while not self._listening():
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited before listening on {self.address}:{self.port}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not listen on {self.address}:{self.port} within {timeout}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)

    def _listening(self) -> bool:
        if self.proc is None:
            return False
        pid = self.proc.pid
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            # /proc/PID/net/tcp is the table of the process's own network namespace
            with open(f"/proc/{pid}/net/tcp") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            return False
        return any(row[3] == "0A" and int(row[1].split(":")[1], 16) == self.port
                   and f"socket:[{row[9]}]" in inodes for row in rows)

    # what tests need

    @property
    def log_path(self) -> Path:
        return self.dir / "sshd.log"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    @property
    def host_key_line(self) -> str:
        return (self.dir / "host_ed25519.pub").read_text().strip()

    @property
    def client_key_path(self) -> str:
        return str(self.dir / "client_ed25519")

    @property
    def known_hosts_line(self) -> str:
        """This server's entry for a known_hosts file ("[address]:port" form)."""
        return f"[{self.address}]:{self.port} {' '.join(self.host_key_line.split()[:2])}"

    @property
    def host_fields(self) -> dict[str, Any]:
        return {"address": self.address, "port": self.port, "username": self.username,
                "key_path": self.client_key_path, "host_key": self.host_key_line}

    def session_pids(self) -> list[int]:
        """The listener's per-connection children: one per open SSH connection."""
        return children_of(self.proc.pid) if self.proc is not None else []

    def transport(self, **options: Any):
        from worker.ssh_transport import SSHTransport

        fields = {k: v for k, v in self.host_fields.items() if k not in options}
        address, port = fields.pop("address", None), fields.pop("port", None)
        return SSHTransport(options.pop("address", address), options.pop("port", port), **fields, **options)
