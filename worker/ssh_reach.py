"""Reaching an SSH host before any command runs: its keys, the OpenSSH client config and ProxyJump hops.

The registered address may be a `Host` alias of the worker user's ~/.ssh/config (or LONGRUN_SSH_CONFIG; empty
turns it off), read as OpenSSH reads it through paramiko's parser: `HostName`, `User`, `Port`, `IdentityFile`
and `ProxyJump` (a chain of `[user@]host[:port]` hops, each looked up in the same file, each host key verified
from known_hosts), and `UserKnownHostsFile` (the files the host's key is looked up in, the first the one a fix
adds it to; else ~/.ssh/known_hosts). What the registration sets wins over the file, as OpenSSH's command line does, except port 22,
the registration's default, which yields to the file's `Port`.
"""

import base64
import binascii
import getpass
import logging
import os
import socket
import time
from collections.abc import Callable

import paramiko

from worker.host_errors import AuthRefused, HostKeyRefused, HostUnreachable

log = logging.getLogger("longrun.worker")


def parse_public_key(line: str) -> paramiko.PKey:
    """An OpenSSH public key line, "ssh-ed25519 AAAA... [comment]", as a paramiko key."""
    parts = line.split()
    if len(parts) < 2:
        raise ValueError(f"not an OpenSSH public key line (expected 'TYPE BASE64 [comment]'): {line!r}")
    try:
        return paramiko.PKey.from_type_string(parts[0], base64.b64decode(parts[1], validate=True))
    except (binascii.Error, paramiko.SSHException, ValueError) as exc:
        raise ValueError(f"not a usable {parts[0]} public key: {exc}") from exc


def describe_key(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class RejectUnknownKey(paramiko.RejectPolicy):
    def __init__(self, advice: Callable[[paramiko.PKey], str]):
        self.advice = advice

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise HostKeyRefused(f"host {hostname} presented an unknown host key ({describe_key(key)}); "
                           f"refusing to connect. {self.advice(key)}")


def load_key(key_path: str | None) -> paramiko.PKey | None:
    if key_path is None:
        return None
    try:
        return paramiko.PKey.from_path(key_path)
    # cryptography raises TypeError for an encrypted key opened without a passphrase
    except (paramiko.PasswordRequiredException, TypeError) as exc:
        raise AuthRefused(f"the SSH key {key_path} is protected by a passphrase; give the host "
                        "a key without one (longrun cannot prompt)") from exc
    except (OSError, paramiko.SSHException, ValueError) as exc:
        raise AuthRefused(f"cannot load the SSH key {key_path}: {exc}") from exc



def no_ssh_server(target: str, exc: BaseException) -> HostUnreachable:
    """The error of a connect to `target` that reached no SSH server that would talk to us, for the API to show.

    Anyone who may register a host names its address and port, so what the socket said (refused, timed out, an
    answer that is no SSH banner, a jump host's refused channel) would tell an open port from a closed one on any
    machine the server reaches: those all read the same, and the socket's words go to the server's log alone. An
    SSH server that answers but shares no algorithm or version with us is said as such, as a refused key is: it
    says no more about the port than that an SSH server is there, and the fix is the user's."""
    if isinstance(exc, paramiko.ssh_exception.IncompatiblePeer):
        return HostUnreachable(f"cannot connect to {target}: an SSH server answered, but: {str(exc)[:200]}")
    log.warning("cannot connect to %s: %s: %s", target, type(exc).__name__, exc)
    return HostUnreachable(f"cannot connect to {target}: unreachable, or not an SSH server (no SSH server answered "
                           "there; the server's log says what the connection met)")


def read_ssh_config(path: str | None) -> paramiko.SSHConfig | None:
    """The OpenSSH client config at `path` (default LONGRUN_SSH_CONFIG, else ~/.ssh/config); None when absent."""
    path = os.environ.get("LONGRUN_SSH_CONFIG", "~/.ssh/config") if path is None else path
    if not path:
        return None
    try:
        return paramiko.SSHConfig.from_path(os.path.expanduser(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, paramiko.ConfigParseError) as exc:
        raise HostUnreachable(f"cannot read the SSH config {path}: {exc}") from exc


def resolve(config: paramiko.SSHConfig | None, name: str, port: int | None, username: str | None,
             key_path: str | None) -> tuple[str, int, str, str | None, str | None]:
    """(address, port, user, key path, ProxyJump) for `name`, the given values winning over the config's."""
    entry = config.lookup(name) if config is not None else {}
    address = entry.get("hostname", name)
    if port in (None, 22) and "port" in entry:
        port = int(entry["port"])
    user = username or entry.get("user") or getpass.getuser()
    if key_path is None:
        key_path = next((k for k in map(os.path.expanduser, entry.get("identityfile", [])) if os.path.exists(k)),
                        None)
    jump = entry.get("proxyjump")
    return address, port or 22, user, key_path, None if jump in (None, "none") else jump


def known_hosts_files(config: paramiko.SSHConfig | None, name: str) -> list[str]:
    """The known_hosts files of `name`'s `UserKnownHostsFile` (whitespace-separated, `~` expanded; `none` for
    none at all), else [~/.ssh/known_hosts], as OpenSSH reads them."""
    entry = config.lookup(name) if config is not None else {}
    given = entry.get("userknownhostsfile")
    files = given.split() if isinstance(given, str) else list(given or [])
    if not files:
        return [os.path.expanduser("~/.ssh/known_hosts")]
    return [os.path.expanduser(f) for f in files if f.lower() != "none"] or [os.devnull]


def parse_hop(hop: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (or `ssh://user@host:port`) of a ProxyJump list."""
    hop = hop.strip().removeprefix("ssh://")
    user, _, rest = hop.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = int(tail[1:]) if tail.startswith(":") else None
    elif rest.count(":") == 1:
        host, _, number = rest.partition(":")
        port = int(number)
    return user or None, host, port


def tcp_socket(address: str, port: int, timeout: float, keepalive: int) -> socket.socket:
    sock = socket.create_connection((address, port), timeout=timeout)
    # commands are a few small packets each: Nagle plus delayed ACKs would add ~40 ms to each
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # paramiko's keepalive only sends; the kernel is what notices a peer that stopped answering
    if keepalive and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, keepalive)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, keepalive)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, keepalive * 4 * 1000)
    return sock



def open_jump_channel(config: paramiko.SSHConfig | None, proxy_jump: str, target: tuple[str, int],
                      known_hosts: str, timeout: float, keepalive: int,
                      ) -> tuple[paramiko.Channel, list[paramiko.SSHClient]]:
    """A channel to `target` through the ProxyJump hops, as `ssh -J` opens it: a connection to the first hop,
    a direct-tcpip channel from each hop to the next, the last one to the target. Returns the channel and the
    hops' connections, which the caller closes with its own."""
    deadline = time.monotonic() + timeout
    hops = [resolve(config, host, port, user, None)[:4]
            for user, host, port in map(parse_hop, proxy_jump.split(","))]
    sock: socket.socket | paramiko.Channel | None = None
    jumps: list[paramiko.SSHClient] = []
    try:
        for (address, port, user, key_path), after in zip(hops, [*hops[1:], target], strict=True):
            left = max(0.1, deadline - time.monotonic())
            if sock is None:
                sock = tcp_socket(address, port, left, keepalive)
            client = paramiko.SSHClient()
            jumps.append(client)
            advice = (f"If you trust the jump host, add its key to {known_hosts} (run "
                      f"`ssh-keyscan -p {port} {address} >> {known_hosts}` where it is reachable)")
            client.set_missing_host_key_policy(RejectUnknownKey(lambda key, text=advice: text))
            if os.path.exists(known_hosts):
                client.load_host_keys(known_hosts)
            pkey = load_key(key_path)
            client.connect(address, port, username=user, pkey=pkey, sock=sock, timeout=left,
                           banner_timeout=left, auth_timeout=left, channel_timeout=left,
                           allow_agent=pkey is None, look_for_keys=pkey is None)
            sock = client.get_transport().open_channel("direct-tcpip", after[:2], ("127.0.0.1", 0),
                                                       timeout=left)
    except BaseException:
        for client in reversed(jumps):
            client.close()
        raise
    return sock, jumps

