"""The API in this process, without the worker: a FastAPI TestClient over a fresh database made by the
Alembic migrations (tests/conftest.py `database_url`). Runs are moved through states with the state machine, as the
worker would."""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.config import Settings
from server.db import Database
from server.hosts import ensure_local_host
from server.lifecycle import RunStatus, transition
from server.models import Run


class App:
    """The app, its database and settings, and a client (with the token when one is set)."""

    def __init__(self, home: Path, database_url: str, token: str | None = None):
        home.mkdir(parents=True, exist_ok=True)
        self.settings = Settings(home=home, api_token=token)
        self.db = Database(database_url)
        with self.db.writing() as s:
            ensure_local_host(s, self.settings)
        self.app = create_app(self.db, self.settings)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # a loopback name: the API answers only to the Host names of its allow-list
        self.client = TestClient(self.app, base_url="http://127.0.0.1", headers=headers)

    @property
    def workspace(self) -> Path:
        return self.settings.local_workspace

    def submit(self, **spec: Any) -> dict[str, Any]:
        """A queued run; a second one of a name still live is named NAME-2 (?name_suffix: no worker ends them)."""
        body = {"name": "toy", "host": "local", "entrypoint": "/opt/train.py", **spec}
        r = self.client.post("/v1/runs", json=body, params={"name_suffix": "true"})
        assert r.status_code == 201, r.text
        return r.json()

    def move(self, run_id: str, *statuses: RunStatus) -> None:
        """Take the run through `statuses` in order, each a legal transition."""
        for status in statuses:
            with self.db.writing() as s:
                transition(s, s.get(Run, run_id), status, f"test: {status}")

    @contextmanager
    def session(self) -> Iterator[Any]:
        with self.db.writing() as s:
            yield s

    @contextmanager
    def serving(self) -> Iterator[str]:
        """The same app behind a real uvicorn server on a free loopback port, for as long as the block runs (its
        URL). For streams: Starlette's TestClient before 1.x hands a response over only once it has ended, so an
        event stream that waits on the test itself would never start there."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(30)

    def close(self) -> None:
        self.client.close()
        self.db.dispose()
