"""Registering a host that is not what it should be, through a real server and worker: a workspace under /proc,
/sys or /dev is a 422 naming it; a port that accepts and stays silent answers as a closed one does (no port
oracle); a host whose python prints junk and exits 1 is not registered."""

import socket
import threading
from collections.abc import Iterator

import pytest

from tests.service import Service


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    done.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


@pytest.fixture
def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


@pytest.mark.parametrize("workspace", ["/proc/self/cwd", "/sys/kernel", "/dev/shm/ws", "//proc/./1/root"])
def test_a_workspace_under_a_kernel_file_system_is_refused_naming_it(service: Service, workspace: str) -> None:
    for address in ("local", "10.0.0.5"):
        r = service.client.post("/v1/hosts", json={"name": "box", "address": address, "workspace": workspace})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", "workspace"] and "kernel file system" in r.text
    assert service.client.get("/v1/hosts/box").status_code == 404


def test_a_silent_port_and_a_closed_one_answer_alike_at_registration(service: Service, silent_port: int,
                                                                      closed_port: int) -> None:
    answers = {}
    for name, port in (("silent", silent_port), ("closed", closed_port)):
        r = service.client.post("/v1/hosts", json={"name": name, "address": "127.0.0.1", "port": port,
                                                   "workspace": "/srv/ws"}, timeout=120)
        assert r.status_code == 201, r.text
        body = r.json()
        answers[name] = (body["reachable"], (body["last_error"] or "").replace(f":{port}", ":PORT"))
    assert answers["silent"] == answers["closed"] and answers["closed"][0] is False
