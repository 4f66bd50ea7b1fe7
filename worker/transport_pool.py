"""Which transport reaches a host, and one cached transport (one connection) per host."""

import threading
from typing import Any, Protocol

from worker.local_transport import LocalTransport
from worker.transport_interface import Transport

LOCAL_ADDRESS = "local"


class HostSettings(Protocol):
    """What a registered host says about reaching it (the server's Host row fits)."""

    name: str
    address: str
    port: int | None
    username: str | None
    key_path: str | None
    host_key: str | None


def settings_of(host: HostSettings) -> tuple:
    """What reaching the host depends on: a transport is re-made when it changes."""
    return tuple(getattr(host, field, None) for field in ("address", "port", "username", "key_path", "host_key"))


def transport_for(host: HostSettings, **options: Any) -> Transport:
    """A new transport for `host`; `options` (timeouts, keepalive, known_hosts) go to SSHTransport."""
    address, port, username, key_path, host_key = settings_of(host)
    if address == LOCAL_ADDRESS:
        return LocalTransport()
    # imported here: a server with only the `local` host never loads paramiko and the cryptography under it (about
    # 0.05-0.1 of a server start's 0.9-1 CPU-s, docs/benchmarks.md)
    from worker.ssh_transport import SSHTransport

    return SSHTransport(address, port or 22, username=username, key_path=key_path, host_key=host_key,
                        name=getattr(host, "name", None), **options)


class TransportPool:
    """One transport per host name, made on first use and re-made when the host's settings change."""

    def __init__(self, **options: Any):
        self.options = options
        self._lock = threading.Lock()
        self._transports: dict[str, tuple[tuple, Transport]] = {}

    def get(self, host: HostSettings) -> Transport:
        settings = settings_of(host)
        stale = None
        with self._lock:
            cached = self._transports.get(host.name)
            if cached is not None and cached[0] == settings:
                return cached[1]
            transport = transport_for(host, **self.options)
            self._transports[host.name] = (settings, transport)
            if cached is not None:
                stale = cached[1]
        if stale is not None:
            stale.close()
        return transport

    def destination(self, name: str) -> str | None:
        """Where the transport made for host `name` connects (an SSH host's, its ~/.ssh/config applied), if one was
        made; never makes one."""
        with self._lock:
            cached = self._transports.get(name)
        return getattr(cached[1], "destination", None) if cached is not None else None

    def close_all(self) -> None:
        with self._lock:
            cached, self._transports = list(self._transports.values()), {}
        for _, transport in cached:
            transport.close()
