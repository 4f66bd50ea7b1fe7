"""The `ssh` transport: one persistent paramiko connection per host, shared by every operation.

Each `exec` opens one channel on that connection, so concurrent callers (several worker threads)
share it. The connection is made on first use and again after any failure: a failed connect is
retried with exponential backoff for at most `connect_timeout`, and callers that queued behind it
get its error at once instead of each waiting their own turn. Host keys are verified, never
learned: the key given at registration, else the user's known_hosts.

The registered address may be an alias of the worker user's ~/.ssh/config, reached through its ProxyJump hops
(worker/ssh_reach.py, with the key helpers).

Commands run under /bin/sh whatever the user's login shell, as with LocalTransport. A command
killed by a signal on the host reports returncode -1 (SSH carries no number for it).

Errors (worker/host_errors.py): `HostUnreachable` when the host did not answer, `HostKeyRefused` for a
key nobody trusted (nothing was run there), `AuthRefused` when the host refused our key.
"""

import os
import selectors
import shlex
import socket
import threading
import time

import paramiko
import tenacity

from worker.host_errors import AuthRefused, HostKeyRefused, HostUnreachable
from worker.ssh_reach import (
    RejectUnknownKey,
    describe_key,
    known_hosts_files,
    load_key,
    no_ssh_server,
    open_jump_channel,
    parse_public_key,
    read_ssh_config,
    resolve,
    tcp_socket,
)
from worker.transport_interface import CommandResult, Transport

# OpenSSH allows 10 sessions per connection by default (MaxSessions): queue beyond that
MAX_CHANNELS = 8
READ_SIZE = 1 << 16


def _worth_retrying(exc: BaseException) -> bool:
    """A connect that failed on the way (no answer, a dropped link) is tried again; a refused key is final."""
    refused = (HostKeyRefused, AuthRefused, paramiko.BadHostKeyException, paramiko.AuthenticationException)
    return isinstance(exc, (OSError, EOFError, paramiko.SSHException)) and not isinstance(exc, refused)


class SSHTransport(Transport):
    def __init__(self, address: str, port: int = 22, username: str | None = None,
                 key_path: str | None = None, host_key: str | None = None,
                 known_hosts: str | None = None, connect_timeout: float = 10,
                 command_timeout: float = 120, keepalive: int = 15, ssh_config: str | None = None,
                 name: str | None = None):
        self.alias = address
        self.name = name  # the host's name in longrun, for the commands an error suggests
        self.ssh_config = read_ssh_config(ssh_config)
        self.address, self.port, self.username, key_path, self.proxy_jump = resolve(
            self.ssh_config, address, port, username, key_path)
        self.key_path = os.path.expanduser(key_path) if key_path else None
        try:
            self.host_key = parse_public_key(host_key) if host_key else None
        except ValueError as exc:
            raise HostKeyRefused(f"the host_key registered for {address}:{port} is unusable: {exc}") from exc
        # the files the host's key is looked up in: those given, else the SSH config's UserKnownHostsFile for the
        # alias, else ~/.ssh/known_hosts; the first is the one a fix adds a key to
        self.known_hosts_files = ([os.path.expanduser(known_hosts)] if known_hosts
                                  else known_hosts_files(self.ssh_config, address))
        self.known_hosts = self.known_hosts_files[0]
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.keepalive = keepalive
        self.round_trips = 0
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._channels = threading.BoundedSemaphore(MAX_CHANNELS)
        # the ProxyJump hops' connections under the current one (closing ours closes them too)
        self._jumps: list[paramiko.SSHClient] = []
        # (monotonic time it ended, error) of the last failed connect: shared by callers that waited on it
        self._last_failure: tuple[float, Exception] | None = None

    @property
    def host_name(self) -> str:
        """The name known_hosts files use for this host."""
        return self.address if self.port == 22 else f"[{self.address}]:{self.port}"

    @property
    def destination(self) -> str:
        """Where this transport connects, its ~/.ssh/config applied: user@address:port [via jump]."""
        via = f" via {self.proxy_jump}" if self.proxy_jump else ""
        return f"{self.username}@{self.address}:{self.port}{via}"

    def __repr__(self) -> str:
        return f"SSHTransport({self.destination})"

    # connection

    def _trust_advice(self, key: paramiko.PKey, changed: bool = False) -> str:
        kind = {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa"}.get(key.get_name(), "ecdsa")
        check = ("If you trust it (compare with the fingerprint printed by "
                 f"`ssh-keygen -lf /etc/ssh/ssh_host_{kind}_key.pub` on the host), ")
        update = f'longrun hosts update {self.name or "HOST"} --host-key "{key.get_name()} {key.get_base64()}"'
        if self.host_key is not None:
            return f"{check}pin it with: {update}"
        keyscan = f"ssh-keyscan -p {self.port} {self.address} >> {self.known_hosts}"
        if changed:
            keyscan = f"ssh-keygen -R '{self.host_name}' -f {self.known_hosts} && {keyscan}"
        return f"{check}pin it with: {update}; or add it to the server's known_hosts: {keyscan}"

    def _new_client(self) -> paramiko.SSHClient:
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(RejectUnknownKey(self._trust_advice))
        if self.host_key is not None:
            client.get_host_keys().add(self.host_name, self.host_key.get_name(), self.host_key)
        else:
            for path in filter(os.path.exists, self.known_hosts_files):
                try:
                    client.load_host_keys(path)
                except (OSError, paramiko.SSHException) as exc:
                    raise HostKeyRefused(f"cannot read known_hosts file {path}: {exc}") from exc
        return client

    def _open_socket(self, timeout: float) -> socket.socket | paramiko.Channel:
        if self.proxy_jump:
            channel, self._jumps = open_jump_channel(self.ssh_config, self.proxy_jump, (self.address, self.port),
                                                     self.known_hosts, timeout, self.keepalive)
            return channel
        return tcp_socket(self.address, self.port, timeout, self.keepalive)

    def _close_jumps(self) -> None:
        jumps, self._jumps = self._jumps, []
        for client in reversed(jumps):
            client.close()

    def _connect_once(self, deadline: float) -> paramiko.SSHClient:
        pkey = load_key(self.key_path)
        client = self._new_client()
        sock = None
        try:
            self._close_jumps()
            sock = self._open_socket(max(0.1, deadline - time.monotonic()))
            remaining = max(0.1, deadline - time.monotonic())
            client.connect(self.address, self.port, username=self.username, pkey=pkey, sock=sock,
                           timeout=remaining, banner_timeout=remaining, auth_timeout=remaining,
                           channel_timeout=self.connect_timeout,
                           allow_agent=pkey is None, look_for_keys=pkey is None)
        except BaseException:
            client.close()
            if sock is not None:
                sock.close()
            self._close_jumps()
            raise
        client.get_transport().set_keepalive(self.keepalive)
        return client

    def _connect(self) -> paramiko.SSHClient:
        """Connect, retrying with exponential backoff (0.1 s doubling to 2 s) until connect_timeout has passed;
        a refused host key or SSH key is final at once."""
        deadline = time.monotonic() + self.connect_timeout
        try:
            for attempt in tenacity.Retrying(wait=tenacity.wait_exponential(multiplier=0.1, min=0.1, max=2.0),
                                             stop=tenacity.stop_before_delay(self.connect_timeout),
                                             retry=tenacity.retry_if_exception(_worth_retrying), reraise=True):
                with attempt:
                    return self._connect_once(deadline)
        except paramiko.BadHostKeyException as exc:
            raise HostKeyRefused(
                f"host {self.host_name} presented the host key {describe_key(exc.key)}, but "
                f"{describe_key(exc.expected_key)} is the one trusted for it; refusing to connect "
                f"(the host was reinstalled, or someone is in between). "
                f"{self._trust_advice(exc.key, changed=True)}"
            ) from exc
        except paramiko.AuthenticationException as exc:
            key = self.key_path or "the default keys in ~/.ssh and the SSH agent"
            raise AuthRefused(f"{self.username}@{self.host_name} refused the SSH key ({key}): "
                            f"{str(exc).rstrip('.')}. "
                            f"Add its public key to ~{self.username}/.ssh/authorized_keys on the host, "
                            "or register the host with the right username and key_path") from exc
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise no_ssh_server(f"{self.username}@{self.address}:{self.port}", exc) from exc

    def _connection(self) -> paramiko.SSHClient:
        asked = time.monotonic()
        with self._lock:
            client = self._client
            if client is not None and client.get_transport() is not None and client.get_transport().is_active():
                return client
            self._client = None
            if client is not None:
                client.close()
            if self._last_failure is not None and self._last_failure[0] >= asked:
                # an attempt made while we waited for the lock just failed: do not queue another one
                error = self._last_failure[1]
                raise type(error)(str(error))
            try:
                self._client = self._connect()
            except (HostUnreachable, HostKeyRefused, AuthRefused) as exc:
                self._last_failure = (time.monotonic(), exc)
                raise
            self._last_failure = None
            return self._client

    def connect(self) -> None:
        self._connection()

    def _drop(self, client: paramiko.SSHClient) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        client.close()

    def transport_object(self) -> paramiko.Transport | None:
        """The live paramiko connection, if any (tests check that it is reused)."""
        client = self._client
        return client.get_transport() if client is not None else None

    # commands

    def exec(self, command: str, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
        with self._count_lock:
            self.round_trips += 1
        timeout = self.command_timeout if timeout is None else timeout
        with self._channels:
            client = self._connection()
            try:
                channel = client.get_transport().open_session(timeout=self.connect_timeout)
            except paramiko.ChannelException as exc:
                # the connection answered but refused a channel: it is still good for others
                raise HostUnreachable(f"{self.host_name} refused a new SSH channel: {exc}") from exc
            except (OSError, EOFError, paramiko.SSHException, AttributeError) as exc:
                self._drop(client)
                raise HostUnreachable(f"connection to {self.host_name} lost: {exc or type(exc).__name__}") from exc
            try:
                return self._run(client, channel, command, stdin or b"", timeout)
            finally:
                channel.close()

    @staticmethod
    def _start(client: paramiko.SSHClient, channel: paramiko.Channel, command: str, deadline: float) -> None:
        """`channel.exec_command` within the deadline. paramiko waits for the host's reply to the request without
        a limit, so a link that dies right after the channel opened would hold the caller until TCP gives up
        (minutes): past the deadline the connection is closed, which ends that wait, and the command times out."""
        fired = threading.Event()

        def give_up() -> None:
            fired.set()
            client.close()

        watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), give_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            channel.exec_command(command)
        except (OSError, EOFError, paramiko.SSHException):
            if fired.is_set():
                raise TimeoutError from None
            raise
        finally:
            watchdog.cancel()

    def _run(self, client: paramiko.SSHClient, channel: paramiko.Channel, command: str, stdin: bytes,
             timeout: float) -> CommandResult:
        deadline = time.monotonic() + timeout
        connection = channel.get_transport()
        out, err = bytearray(), bytearray()
        try:
            # the login shell may be fish or csh: hand the command to /bin/sh, as LocalTransport does
            self._start(client, channel, f"exec /bin/sh -c {shlex.quote(command)}", deadline)
            pending = memoryview(stdin)
            if not pending:
                channel.shutdown_write()
            with selectors.DefaultSelector() as selector:
                selector.register(channel.fileno(), selectors.EVENT_READ)
                # stdin is sent in step with reading, so a command that writes before it reads cannot stall us
                while True:
                    if pending and channel.send_ready():
                        pending = self._send(channel, pending, connection)
                        if not pending and not channel.closed:
                            channel.shutdown_write()
                    while channel.recv_ready():
                        out += channel.recv(READ_SIZE)
                    while channel.recv_stderr_ready():
                        err += channel.recv_stderr(READ_SIZE)
                    if channel.eof_received or channel.closed:
                        # what arrived between the reads above and the end of the stream
                        while channel.recv_ready():
                            out += channel.recv(READ_SIZE)
                        while channel.recv_stderr_ready():
                            err += channel.recv_stderr(READ_SIZE)
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    if not connection.is_active():
                        raise EOFError("connection closed")
                    selector.select(min(left, 0.02 if pending else 1.0))
            while not channel.status_event.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError
                if not connection.is_active():
                    raise EOFError("connection closed")
        except TimeoutError:
            if not self._alive(client):
                self._drop(client)
            raise HostUnreachable(f"command on {self.host_name} did not finish within {timeout:g}s") from None
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self._drop(client)
            raise HostUnreachable(f"connection to {self.host_name} lost during a command: "
                                 f"{exc or type(exc).__name__}") from exc
        # a channel that closed without the host's EOF went down with the connection; check it that way, as
        # paramiko closes the channels (exit_status_ready() turns true) before it marks the connection inactive
        if channel.exit_status == -1 and not (channel.eof_received and connection.is_active()):
            self._drop(client)
            raise HostUnreachable(f"connection to {self.host_name} lost during a command")
        # -1: the command ended without an exit status (killed by a signal on the host)
        return CommandResult(channel.exit_status, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    @staticmethod
    def _send(channel: paramiko.Channel, pending: memoryview, connection: paramiko.Transport) -> memoryview:
        """What is left of `pending` after one send. A command may end without reading all its input (the agent
        reads its request line; the bytes after it are for an install it did not need): once the host has closed
        the channel nothing more is sent, and the command's end is read as usual; a connection that went down is
        still an error."""
        if channel.closed:
            return memoryview(b"")
        try:
            return pending[channel.send(pending[:READ_SIZE]):]
        except OSError:
            if not connection.is_active():
                raise
            return memoryview(b"")  # the host closed the channel between the look and the send

    def _alive(self, client: paramiko.SSHClient) -> bool:
        """Whether the connection still answers: a command may time out on a healthy one."""
        try:
            client.get_transport().open_session(timeout=min(self.connect_timeout, 5.0)).close()
            return True
        except (OSError, EOFError, paramiko.SSHException, AttributeError):
            return False

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        self._close_jumps()
