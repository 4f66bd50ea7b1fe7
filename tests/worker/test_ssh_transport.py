"""SSHTransport against a real OpenSSH sshd (tests/sshd.py) and, for a separate host, a network namespace."""

import hashlib
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import paramiko
import pytest

from server.config import Settings
from server.models import Host
from tests.netns import NetNamespace, PrivateNetwork
from tests.sshd import SshServer
from worker.host_agent import HostAgent
from worker.host_errors import AuthRefused, CommandFailed, HostKeyRefused, HostUnreachable
from worker.hostside.procfs import pids_with_token
from worker.protocol import CleanAnswer, LaunchRequest, ReadFrom
from worker.ssh_transport import SSHTransport
from worker.supervisor import Supervisor
from worker.transport_pool import TransportPool, transport_for

pytestmark = pytest.mark.slow  # a real sshd


@pytest.fixture(scope="module")
def sshd():
    with SshServer() as server:
        yield server


@pytest.fixture
def transport(sshd):
    t = sshd.transport(connect_timeout=3, command_timeout=30)
    yield t
    t.close()


def other_key_line(tmp_path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    return (tmp_path / "other.pub").read_text().strip()


def test_exec_returns_stdout_stderr_and_exit_code(transport):
    result = transport.exec("echo out; echo err >&2; exit 3")
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    # run by /bin/sh whatever the login shell, as LocalTransport does
    assert transport.exec("echo $0").stdout == "/bin/sh\n"


def test_stdin_is_delivered(transport):
    assert transport.exec("cat; echo .", stdin=b"line 1\nline 2").stdout == "line 1\nline 2.\n"
    assert transport.exec("cat").stdout == ""


def test_a_command_that_ends_without_reading_its_input_gives_its_exit_code(transport):
    """The host agent reads its request line and may exit without the bytes after it (an install it did not need):
    the command's output and exit code come back, not "connection lost", however much input was still unsent."""
    for _ in range(3):
        result = transport.exec("head -c 5; echo; exit 3", stdin=b"hello" + os.urandom(16 << 20))
        assert (result.returncode, result.stdout) == (3, "hello\n")
    assert transport.exec("echo still connected").stdout == "still connected\n"


def test_large_output_on_both_streams_comes_back_intact(transport):
    # 4 MB in, 4 MB out while reading, 4 MB on stderr: more than any SSH window or pipe buffer
    blob = os.urandom(3 << 20).hex()[: 4 << 20].encode()
    script = ("import sys\n"
              "data = sys.stdin.buffer.read()\n"
              "for i in range(0, len(data), 65536):\n"
              "    sys.stdout.buffer.write(data[i:i + 65536]); sys.stderr.buffer.write(data[i:i + 65536])\n")
    result = transport.exec(shlex.join([sys.executable, "-c", script]), stdin=blob)
    assert result.returncode == 0
    assert len(result.stdout) == len(result.stderr) == len(blob)
    digest = hashlib.sha256(blob).hexdigest()
    assert hashlib.sha256(result.stdout.encode()).hexdigest() == digest
    assert hashlib.sha256(result.stderr.encode()).hexdigest() == digest


def test_commands_reuse_one_connection(sshd, transport):
    transport.exec("true")
    connection = transport.transport_object()
    for i in range(10):
        assert transport.exec(f"echo {i}").stdout == f"{i}\n"
    assert transport.transport_object() is connection
    assert transport.round_trips == 11
    # connections of earlier tests may take a moment to go away
    wait_for(lambda: len(sshd.session_pids()) == 1, timeout=30)


def test_concurrent_exec_from_eight_threads(sshd, transport):
    results, errors = {}, []

    def work(n: int) -> None:
        try:
            for j in range(5):
                results[(n, j)] = transport.exec(f"sleep 0.05; echo {n}-{j}").stdout
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert results == {(n, j): f"{n}-{j}\n" for n in range(8) for j in range(5)}
    assert transport.round_trips == 40
    # connections of earlier tests may take a moment to go away
    wait_for(lambda: len(sshd.session_pids()) == 1, timeout=30)


def test_command_timeout_raises_and_keeps_the_connection(transport):
    transport.exec("true")
    connection = transport.transport_object()
    with pytest.raises(HostUnreachable, match="did not finish within 1s"):
        transport.exec("sleep 4", timeout=1)
    assert transport.exec("echo ok").stdout == "ok\n"
    assert transport.transport_object() is connection


def test_wrong_host_key_is_refused_before_anything_runs(sshd, tmp_path):
    marker = tmp_path / "ran"
    t = sshd.transport(host_key=other_key_line(tmp_path), connect_timeout=3)
    with pytest.raises(HostKeyRefused) as refused:
        t.exec(shlex.join(["touch", str(marker)]))
    message = str(refused.value)
    presented = subprocess.run(["ssh-keygen", "-lf", "-"], input=sshd.host_key_line, capture_output=True,
                               text=True, check=True).stdout.split()[1]
    assert presented in message and "ssh-ed25519" in message
    assert f'longrun hosts update HOST --host-key "{" ".join(sshd.host_key_line.split()[:2])}"' in message
    assert not marker.exists()


def test_unknown_host_key_is_refused(sshd, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    t = sshd.transport(host_key=None, known_hosts=str(known_hosts), connect_timeout=3)
    with pytest.raises(HostKeyRefused, match="unknown host key") as refused:
        t.exec("true")
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {known_hosts}" in str(refused.value)


def test_known_hosts_entry_for_a_non_default_port_is_trusted(sshd, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:1 {other_key_line(tmp_path)}\n{sshd.known_hosts_line}\n")
    t = sshd.transport(host_key=None, known_hosts=str(known_hosts), connect_timeout=3)
    try:
        assert t.exec("echo trusted").stdout == "trusted\n"
    finally:
        t.close()


def test_a_key_the_host_does_not_accept_is_an_auth_error(sshd, tmp_path):
    other_key_line(tmp_path)
    t = sshd.transport(key_path=str(tmp_path / "other"), connect_timeout=3)
    with pytest.raises(AuthRefused, match="authorized_keys"):
        t.exec("true")


def test_shell_metacharacters_arrive_literally(transport, tmp_path):
    argument = f"a b; touch {tmp_path}/pwned $(touch {tmp_path}/pwned) `id` 'q' \"d\" \\ * ? > < | & $HOME\n2"
    result = transport.exec(shlex.join(["printf", "%s", argument]))
    assert result.stdout == argument
    assert not (tmp_path / "pwned").exists()


def test_unreachable_host_raises_transport_error_then_reconnects():
    with SshServer() as server:
        t = server.transport(connect_timeout=2, command_timeout=10)
        try:
            assert t.exec("echo one").stdout == "one\n"
            before = t.transport_object()
            server.stop()
            for _ in range(2):  # the dropped connection, then a refused reconnect: said at once, not timed out
                with pytest.raises(HostUnreachable) as raised:
                    t.exec("echo two")
                assert "did not finish" not in str(raised.value), raised.value
            # callers that queued behind a failing reconnect share its answer instead of each retrying
            errors = []
            threads = [threading.Thread(target=lambda: errors.append(_error_of(t, "echo many")))
                       for _ in range(8)]
            started = time.monotonic()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            assert [type(e) for e in errors] == [HostUnreachable] * 8
            assert time.monotonic() - started < 8
            server.start()
            assert t.exec("echo three").stdout == "three\n"
            assert t.transport_object() is not before
        finally:
            t.close()


def test_connection_cut_during_a_command_is_a_transport_error_not_an_exit_status():
    with SshServer() as server:
        t = server.transport(connect_timeout=2, command_timeout=10)
        try:
            t.exec("true")
            cut = threading.Timer(0.5, server.stop)
            cut.start()
            # an answer here (exit -1, no output) would read as a failed command, and fail the run
            with pytest.raises(HostUnreachable, match="lost"):
                t.exec("sleep 3; echo done")
            cut.join()
            # a command killed by a signal on a healthy connection still reports -1
            server.start()
            assert t.exec("echo hi; kill -9 $$").returncode == -1
        finally:
            t.close()


def test_a_host_that_goes_silent_as_a_command_starts_times_the_command_out(monkeypatch):
    """The link dies between the channel's opening and the start of the command, a window in which paramiko waits
    for the host's reply without a limit: the command still gives up at its timeout, and the next one reconnects."""
    with SshServer() as server:
        t = server.transport(connect_timeout=2, command_timeout=3)
        frozen: list[int] = []
        try:
            t.exec("true")
            real_open = paramiko.Transport.open_session

            def open_then_go_silent(self, *args, **kwargs):
                channel = real_open(self, *args, **kwargs)
                monkeypatch.setattr(paramiko.Transport, "open_session", real_open)
                for pid in server.session_pids():  # each connection's sshd processes, stopped: no answer, no reset
                    os.killpg(pid, signal.SIGSTOP)
                    frozen.append(pid)
                return channel

            monkeypatch.setattr(paramiko.Transport, "open_session", open_then_go_silent)
            # cut by the command's own timeout, not TCP's minutes
            with pytest.raises(HostUnreachable, match="did not finish within 3s"):
                t.exec("echo hi")
            assert frozen, "no sshd session was stopped"
            assert t.exec("echo back").stdout == "back\n"  # a new connection, to the sshd that still listens
        finally:
            for pid in frozen:
                os.killpg(pid, signal.SIGCONT)
            t.close()


def test_pool_keeps_one_transport_per_host_until_its_settings_change(sshd):
    class Host:
        name = "h1"
        address, port, username = sshd.address, sshd.port, sshd.username
        key_path, host_key = sshd.client_key_path, sshd.host_key_line

    pool = TransportPool(connect_timeout=3)
    try:
        first = pool.get(Host)
        assert isinstance(first, SSHTransport) and pool.get(Host) is first
        assert first.exec("echo pooled").stdout == "pooled\n"
        Host.port = sshd.port + 1
        assert pool.get(Host) is not first
    finally:
        pool.close_all()
    Host.address = "local"
    assert type(transport_for(Host)).__name__ == "LocalTransport"


# HostAgent over SSH: the same launch, probe, cancel and clean code as on a local host

JOB = textwrap.dedent("""\
    import json, os, sys, time
    with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
        for step in range(3):
            f.write(json.dumps({"step": step, "total_steps": 100, "loss": 1.0 / (step + 1)}) + "\\n")
            f.flush()
    print("started", flush=True)
    time.sleep(300)
""")


def wait_for(condition, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)
    return value


def test_host_agent_over_ssh_launches_probes_cancels_and_refuses_unsafe_cleans(transport, tmp_path):
    workspace = tmp_path / "workspace"
    (workspace / "out").mkdir(parents=True)
    (workspace / "out" / "keep").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    (workspace / "escape").symlink_to(outside)
    (workspace / "job.py").write_text(JOB)

    agent = HostAgent(transport, workspace=str(workspace), python=sys.executable)
    directory = agent.layout.attempt_dir("run1", 1)
    token = uuid.uuid4().hex
    try:
        launched = agent.launch(LaunchRequest(directory, token, [sys.executable, str(workspace / "job.py")], {}))
        assert launched.already is False
        answer = wait_for(lambda: (a := agent.probe(directory, ReadFrom())).metrics.count("\n") == 3 and a)
        assert answer.state == "running"
        assert [line for line in answer.metrics.splitlines() if '"step": 2' in line]
        assert pids_with_token(token), "sshd runs on this machine: the job's processes are visible here"

        cancelled = agent.cancel(directory, grace=2)
        assert cancelled.remaining == []
        assert pids_with_token(token) == []
        assert agent.probe(directory, ReadFrom(answer.metrics_offset, 0)).state == "exited"

        for path in (str(outside), str(workspace / "escape"), str(workspace / "escape" / "."), "/"):
            with pytest.raises(CommandFailed, match="refusing"):
                agent.clean(path)
        assert (outside / "precious").exists()
        assert agent.clean(str(workspace / "out")) == CleanAnswer(removed=1, kept=[])
    finally:
        HostAgent(transport, workspace=str(workspace), python=sys.executable).cancel(directory, grace=1)


def test_a_host_in_another_network_namespace_drops_off_and_comes_back():
    with NetNamespace() as ns, SshServer(netns=ns) as server:
        t = server.transport(connect_timeout=2, command_timeout=5, keepalive=2)
        try:
            assert server.address == ns.address and ns.address.startswith("10.213.")
            assert t.exec("ip -4 -o addr show").stdout.count(ns.address) == 1
            ns.set_link(False)
            # the command's 5 s and the connection check's 2 s cut it, not TCP's minutes
            with pytest.raises(HostUnreachable):
                t.exec("echo unreachable")
            ns.set_link(True)
            assert wait_for(lambda: _answers(t), timeout=60) == "back\n"
        finally:
            t.close()


def test_hosts_on_one_private_network_reach_each_other():
    with PrivateNetwork() as net, net.namespace() as a, net.namespace() as b, SshServer(netns=b) as sshd_b:
        banner = (f"import socket; s = socket.create_connection(({b.address!r}, {sshd_b.port}), timeout=5); "
                  "print(s.recv(8).decode())")
        reached = a.run([sys.executable, "-c", banner], capture_output=True, text=True, timeout=20)
        assert reached.stdout.startswith("SSH-"), reached.stderr
        assert a.address != b.address and a.gateway == b.gateway == net.gateway


def _error_of(t: SSHTransport, command: str) -> Exception | None:
    try:
        t.exec(command)
    except Exception as exc:
        return exc
    return None


def _answers(t: SSHTransport) -> str | None:
    try:
        return t.exec("echo back").stdout
    except HostUnreachable:
        return None


def test_the_worker_connects_to_a_registered_host_before_its_first_command(sshd, db):
    with db.writing() as s:
        s.add(Host(name="box", workspace="/tmp", python=sys.executable, **sshd.host_fields))
    with db.reading() as s:
        host = s.query(Host).one()
    before = set(sshd.session_pids())
    supervisor = Supervisor(db, Settings(ssh_connect_timeout=3))
    try:
        supervisor.tick()
        transport = supervisor.transports.get(host)
        connection = wait_for(transport.transport_object)
        assert supervisor.warmer.run_once() == [], "warmed once, not on every tick"
        assert transport.exec("echo first").stdout == "first\n"
        assert transport.transport_object() is connection, "the first command used the warm connection"
        assert len(set(sshd.session_pids()) - before) == 1
    finally:
        supervisor.stop()
        supervisor.close()
