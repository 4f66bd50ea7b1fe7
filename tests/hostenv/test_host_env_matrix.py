"""The host-environment matrix: the host agent's whole loop (launch -> probe -> cancel -> clean) on hosts that are not
this suite's own environment: each locale, stdio encoding and UTF-8 mode, each host python from the floor up, /bin/sh
as dash and as bash, a non-root user, /tmp mounted noexec, a workspace named with spaces and other letters, and an SSH
login whose .bashrc prints a banner. Each row runs on the `local` transport and over a real sshd started for it; the
rows are named in docs/reliability.md ("The host-environment matrix").

Every workspace here is named with a space and letters outside ASCII. The job writes its log as bytes (its own
stdio encoding is the host's business, not the agent's) and a metric line per step; its source is ASCII, as a job's
command line must be where the host's python decodes argv as ASCII (LC_ALL=C with PYTHONUTF8=0)."""

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.sshd import SshServer
from worker.host_agent import HostAgent
from worker.hostside.procfs import pids_with_token
from worker.local_transport import LocalTransport
from worker.protocol import LaunchRequest, ReadFrom
from worker.transport_interface import CommandResult

# the oldest python the README names for hosts, and newer ones
HOST_PYTHONS = {"3.8": "python3.8", "3.12": "python3.12", "3.13": "python3.13"}
# a user of this test process's own: several pytest processes may run these rows at once, each making and removing
# its user
MATRIX_USER = f"longrun-matrix-{os.getpid()}"
WORKSPACE_NAME = "work space ś Ünïcode ☃"
LOCALE_VARS = ("LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES")

JOB = r"""
import json, os, sys, time
out = os.fdopen(1, "wb", buffering=0)
out.write("step log h\u00e9llo \u2603 \x1b[0m\n".encode("utf-8") + b"raw \xff\xfe bytes\n")
with open(os.environ["LONGRUN_METRICS_FILE"], "a", encoding="utf-8") as f:
    for step in range(1, 100000):
        f.write(json.dumps({"step": step, "loss": 1.0 / step, "note": "\u015b"}) + "\n"); f.flush()
        time.sleep(0.05)
"""


def host_python(version: str) -> str:
    """A python of that version on this machine (pyenv's, where the image has them), else the test fails saying so:
    the matrix is the claim that hosts at these versions work."""
    name = HOST_PYTHONS[version]
    # pyenv's own builds before PATH: a pyenv shim on PATH answers only for the version pyenv has selected
    found = next((str(p) for p in sorted(Path("/root/.pyenv/versions").glob(f"{version}.*/bin/{name}"))
                  if os.access(p, os.X_OK)), None) or shutil.which(name)
    if found is None:
        pytest.fail(f"no {name} on this machine for the host matrix: install Python {version} (pyenv install "
                    f"{version}, or the distribution's package) so that {name} is on PATH")
    return found


@dataclass
class Row:
    """One host environment: the variables its login gets (None: unset), its python, its shell and user."""

    env: dict[str, str | None] = field(default_factory=dict)
    python: str | None = None  # a version from HOST_PYTHONS; None: the system python (/usr/bin/python3)
    shell: str = "/bin/sh"
    user: str | None = None  # None: this test's own user
    noexec_tmp: bool = False
    banner: bool = False


ROWS = {
    "locale-C": Row({"LANG": "C", "LC_ALL": "C"}),
    "locale-POSIX": Row({"LANG": "POSIX", "LC_ALL": "POSIX"}),
    "locale-C.UTF-8": Row({"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}),
    "locale-en_US.UTF-8": Row({"LANG": "en_US.UTF-8", "LC_ALL": "en_US.UTF-8"}),
    "LANG-unset": Row({name: None for name in LOCALE_VARS}),
    "PYTHONIOENCODING-utf-8-strict": Row({"LC_ALL": "en_US.UTF-8", "PYTHONIOENCODING": "utf-8:strict"}),
    "PYTHONIOENCODING-latin-1": Row({"PYTHONIOENCODING": "latin-1"}),
    "PYTHONUTF8-0-under-C": Row({"LC_ALL": "C", "PYTHONUTF8": "0"}),
    "PYTHONUTF8-1": Row({"PYTHONUTF8": "1"}),
    "python-3.8-floor": Row({"LC_ALL": "en_US.UTF-8"}, python="3.8"),
    "python-3.12": Row({"LC_ALL": "C"}, python="3.12"),
    "python-3.13": Row({"LC_ALL": "en_US.UTF-8"}, python="3.13"),
    "sh-is-dash": Row(shell="/bin/dash"),
    "sh-is-bash": Row(shell="/bin/bash"),
    "non-root-user": Row({"LC_ALL": "en_US.UTF-8"}, user=MATRIX_USER),
    "tmp-noexec": Row(noexec_tmp=True),
    "bashrc-banner": Row(shell="/bin/bash", user=MATRIX_USER, banner=True),
}


def _python_for(row: Row) -> str:
    return host_python(row.python) if row.python else "/usr/bin/python3"


def _environment(row: Row) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    for name, value in row.env.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


class RowTransport(LocalTransport):
    """The local transport as that host runs it: the row's shell, user, environment and mounts."""

    def __init__(self, row: Row):
        super().__init__()
        self.row = row

    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        self.round_trips += 1
        argv = [self.row.shell, "-c", command]
        if self.row.noexec_tmp:
            # a mount namespace of the command's own, /tmp in it a fresh noexec tmpfs
            argv = NoexecTmp.command(argv)
        if self.row.user:
            argv = ["setpriv", f"--reuid={self.row.user}", f"--regid={self.row.user}", "--init-groups", *argv]
        proc = subprocess.run(argv, input=stdin or b"", capture_output=True, timeout=timeout, env=_environment(self.row),
                              cwd="/")
        return CommandResult(proc.returncode, proc.stdout.decode("utf-8", "replace"),
                             proc.stderr.decode("utf-8", "replace"))


def accounts(argv: list[str], attempts: int = 50) -> None:
    """useradd / usermod, tried again while another process holds /etc/passwd's lock (exit 10; several pytest
    processes make their users at once); any other failure fails the test."""
    for attempt in range(attempts):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode == 0:
            return
        if done.returncode != 10 and "lock" not in done.stderr:
            break
        time.sleep(0.05 * (attempt + 1))
    pytest.fail(f"{argv[0]} failed (exit {done.returncode}): {done.stderr.strip()}")


@pytest.fixture(scope="module")
def matrix_user() -> Iterator[pwd.struct_passwd]:
    """A non-root user with a home of its own and bash as its shell, created for these tests and removed after."""
    if os.geteuid() != 0:
        pytest.fail("the host matrix creates a user: run it as root (as `make test` on CI does)")
    home = Path(tempfile.mkdtemp(prefix="longrun-matrix-home-", dir="/var/tmp"))
    subprocess.run(["userdel", "-r", MATRIX_USER], capture_output=True)
    # '*': no password, yet not locked (sshd without PAM refuses a locked account's key)
    accounts(["useradd", "--home-dir", str(home), "--shell", "/bin/bash", "--password", "*", MATRIX_USER])
    shutil.chown(home, MATRIX_USER, MATRIX_USER)
    os.chmod(home, 0o755)
    yield pwd.getpwnam(MATRIX_USER)
    subprocess.run(["pkill", "-KILL", "-u", MATRIX_USER], capture_output=True)
    subprocess.run(["userdel", MATRIX_USER], capture_output=True)
    shutil.rmtree(home, ignore_errors=True)


def _workspace(row: Row, owner: pwd.struct_passwd | None) -> Path:
    # not under /tmp (a noexec tmpfs hides it there) nor under /root (another user cannot enter it)
    base = Path(tempfile.mkdtemp(prefix="longrun-matrix-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    ws = base / WORKSPACE_NAME
    ws.mkdir()
    if owner is not None:
        os.chown(ws, owner.pw_uid, owner.pw_gid)
    return ws


def _row_holds(agent: HostAgent, row: Row, user: str | None, login: bool) -> None:
    """The host is what the row says, seen through the transport: its user, its mounts, and over an SSH login its
    banner (bash reads .bashrc for an ssh command; a local `bash -c` reads none)."""
    seen = agent.transport.exec("id -un; grep ' /tmp ' /proc/self/mounts || true", timeout=30)
    assert (user or pwd.getpwuid(os.geteuid()).pw_name) in seen.stdout.split("\n"), seen
    assert ("noexec" in seen.stdout) == row.noexec_tmp, seen.stdout
    assert ("Welcome to the login node" in seen.stdout) == (row.banner and login), seen.stdout


def _loop(agent: HostAgent, python: str, ws: Path, name: str, user: str | None, login: bool) -> None:
    """launch -> probe (metrics and the log, bytes intact) -> cancel (verified: nothing left) -> clean."""
    _row_holds(agent, ROWS[name], user, login)
    token = f"tok-matrix-{name}-{os.getpid()}"
    output = ws / "out ś"
    d = agent.layout.attempt_dir(f"run {name}", 1)
    launched = agent.launch(LaunchRequest(d, token, [python, "-c", JOB], {"LONGRUN_OUTPUT_DIR": str(output)},
                                          cwd=str(ws)))
    assert agent.launch(LaunchRequest(d, token, [python, "-c", JOB], {}, cwd=str(ws))).already, \
        "the second call (the agent installed by the first) reads its request"
    assert launched.pid
    deadline, metrics, log = time.monotonic() + 60, "", ""
    read = ReadFrom()
    while time.monotonic() < deadline:
        probe = agent.probe(d, read)
        metrics, log = metrics + probe.metrics, log + probe.log
        read = ReadFrom(probe.metrics_offset, probe.log_offset, probe.metrics_identity, probe.log_identity)
        assert probe.state == "running", (probe.state, log)
        if metrics.count("\n") >= 3 and "raw" in log:
            break
        time.sleep(0.1)
    assert '"note": "\\u015b"' in metrics or '"note": "ś"' in metrics, metrics[:300]
    assert "héllo ☃" in log and "raw \ufffd\ufffd bytes" in log, repr(log[:300])
    answer = agent.cancel(d, grace=3)
    assert answer.remaining == [] and pids_with_token(token) == []
    output.mkdir(exist_ok=True)
    (output / "checkpoint ☃.pt").write_bytes(b"x")
    if ws.stat().st_uid != os.geteuid():
        shutil.chown(output, ws.stat().st_uid, ws.stat().st_gid)
        shutil.chown(output / "checkpoint ☃.pt", ws.stat().st_uid, ws.stat().st_gid)
    agent.clean(str(output))
    assert output.is_dir() and list(output.iterdir()) == []


@pytest.mark.parametrize("name", list(ROWS))
def test_local_host(name: str, request: pytest.FixtureRequest) -> None:
    row = ROWS[name]
    owner = request.getfixturevalue("matrix_user") if row.user else None
    ws = _workspace(row, owner)
    try:
        python = _python_for(row)
        _loop(HostAgent(RowTransport(row), str(ws), python), python, ws, name, row.user, login=False)
    finally:
        shutil.rmtree(ws.parent, ignore_errors=True)


NOEXEC_TMP = 'mount -t tmpfs -o noexec,nosuid,nodev tmpfs /tmp && exec "$@"'


class NoexecTmp:
    """Where sshd runs for the tmp-noexec row: this network, a mount namespace of its own with /tmp noexec."""

    address = "127.0.0.1"

    @staticmethod
    def command(argv: list[str]) -> list[str]:
        return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", NOEXEC_TMP, "-", *argv]


# over SSH the row's difference reaches the host through the login: its variables (sshd's SetEnv sets them for the
# session, as a login node's profile would), its user's login shell (the sh-is-* rows: that user's shell is dash or
# bash), its .bashrc, and for tmp-noexec the mounts sshd runs under
@pytest.mark.parametrize("name", list(ROWS))
def test_ssh_host(name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sshd import free_port

    row = ROWS[name]
    user = row.user or (MATRIX_USER if row.shell != "/bin/sh" else None)
    owner = request.getfixturevalue("matrix_user") if user else None
    ws = _workspace(row, owner)
    env = {k: v for k, v in row.env.items() if v is not None}
    where = {}
    if row.noexec_tmp:
        monkeypatch.setattr(tempfile, "tempdir", "/var/tmp")  # sshd's keys and config outside the hidden /tmp
        where = {"netns": NoexecTmp, "ns_loopback": True, "port": free_port()}
    try:
        with SshServer(username=user, env=env, **where) as server:
            _ssh_loop(server, row, user, ws, name)
    finally:
        shutil.rmtree(ws.parent, ignore_errors=True)


def _ssh_loop(server: SshServer, row: Row, user: str | None, ws: Path, name: str) -> None:
    if user:
        accounts(["usermod", "--shell", row.shell if row.shell != "/bin/sh" else "/bin/bash", MATRIX_USER])
        # a login node's .bashrc often greets on both streams (bash reads it for an ssh command too)
        rc = Path(pwd.getpwnam(user).pw_dir) / ".bashrc"
        rc.write_text("echo 'Welcome to the login node (a banner on stdout)'\necho 'a banner on stderr' >&2\n"
                      if row.banner else "")
        # sshd reads the user's authorized keys as that user
        os.chmod(server.dir, 0o755)
        shutil.chown(server.dir / "authorized_keys", user, user)
        python = _python_for(row)
        transport = server.transport()
        try:
            _loop(HostAgent(transport, str(ws), python), python, ws, name, user, login=True)
        finally:
            transport.close()


def test_every_row_is_named_in_the_reliability_doc() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    missing = [name for name in ROWS if f"`{name}`" not in doc]
    assert missing == [], f"rows not named in docs/reliability.md: {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
