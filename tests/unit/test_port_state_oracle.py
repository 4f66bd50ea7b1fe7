"""Registering a host is naming any address and port the server reaches: what a failed connect says in the API
(a host's last_error, a run's message) must not tell an open port from a closed one. The socket's own words go to
the server's log."""

import logging
import socket
import threading
from collections.abc import Iterator

import pytest

from worker.host_errors import HostUnreachable
from worker.ssh_transport import SSHTransport


def _answering(reply: bytes) -> Iterator[int]:
    """A port that accepts and answers `reply` (no SSH banner), then closes; its number."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(reply)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    done.set()
    thread.join(5)
    server.close()


@pytest.fixture
def http_port() -> Iterator[int]:
    yield from _answering(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture
def smtp_port() -> Iterator[int]:
    yield from _answering(b"220 mail.example ESMTP ready\r\n")


@pytest.fixture
def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]  # closed once the block ends: connects are refused


def failure(port: int) -> str:
    transport = SSHTransport("127.0.0.1", port, username="ml", connect_timeout=0.5, known_hosts="/nonexistent")
    with pytest.raises(HostUnreachable) as raised:
        transport.connect()
    return str(raised.value).replace(f":{port}", ":PORT")


def test_an_open_port_that_is_no_ssh_server_reads_as_a_closed_one(http_port: int, smtp_port: int,
                                                                   closed_port: int, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="longrun.worker")
    said = {failure(closed_port), failure(http_port), failure(smtp_port)}
    assert len(said) == 1, said
    (message,) = said
    assert "unreachable, or not an SSH server" in message and "ml@127.0.0.1:PORT" in message
    for words in ("refused", "banner", "Errno", "reset", "timed out"):
        assert words not in message.lower(), message
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "Connection refused" in logged and "protocol banner" in logged, "the detail is in the server's log"
