"""The Python client of longrun's REST API (v1); the `longrun` command is built on it.

    from longrun import Client

    client = Client("http://127.0.0.1:8080", token="s3cret")    # or LONGRUN_URL / LONGRUN_API_TOKEN
    run = client.submit({"name": "toy", "host": "local", "entrypoint": "/abs/train.py", "args": ["--steps", "40"]})
    for snapshot in client.watch(run["id"]):                    # follows the run's events until it ends
        print(snapshot["status"], snapshot["progress"])
    client.restart(run["id"], ttt_steps=5, clean=True, dry_run=True)   # the predicted duration, nothing changed

A run is named by its id, a unique prefix of it, or its unique name, wherever a method takes `run_id`.

Answers are the API's JSON as dicts (shapes in docs/architecture.md and /openapi.json). A refusal raises an
APIError subclass carrying the server's message; a server that cannot be reached raises ServerUnreachable.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import httpx_sse
import tenacity

DEFAULT_URL = "http://127.0.0.1:8080"
# a run's and an attempt's statuses (docs/api.md), as the server's lifecycle names them: the client does not import
# the server, and tests/test_shared_names.py fails when these drift from it; the CLI's views key their styles by them
RUN_STATUSES = ("queued", "launching", "running", "cancelling", "restarting", "succeeded", "failed", "cancelled")
ATTEMPT_STATUSES = ("pending", "running", "succeeded", "failed", "cancelled")
# the statuses a run stays in until restarted
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
# the most metric points the server puts in one answer (server/queries.py MAX_POINTS_PER_ANSWER)
METRICS_PAGE = 20_000


class LongrunError(Exception):
    """Anything the client could not do."""


class ServerUnreachable(LongrunError):
    def __init__(self, url: str):
        super().__init__(f"cannot reach the server at {url} (start it with `longrun serve`, or set LONGRUN_URL)")
        self.url = url


class APIError(LongrunError):
    """The server refused the request: `status_code`, its `detail` as sent, and `message`, one readable line."""

    def __init__(self, status_code: int, detail: Any):
        self.status_code, self.detail = status_code, detail
        self.message = _readable(detail)
        super().__init__(f"{status_code} {self.message}")


class Unauthorized(APIError):
    """401: no or a wrong bearer token (LONGRUN_API_TOKEN)."""


class NotFound(APIError):
    """404: no such run, host, attempt or evaluation."""


class Conflict(APIError):
    """409: the run's state does not allow it (`status` says which state), or a name is taken."""

    def __init__(self, status_code: int, detail: Any, status: str | None = None):
        super().__init__(status_code, detail)
        self.status = status


class InvalidRequest(APIError):
    """422: `errors` lists each wrong field as {"loc": [...], "msg": ...}."""

    @property
    def errors(self) -> list[dict[str, Any]]:
        return self.detail if isinstance(self.detail, list) else []


class Unavailable(APIError):
    """503: the answer is not there yet (a host's first GPU snapshot)."""


class _ServerError(APIError):
    """5xx other than 503: the server failed (or is going down); a follower waits for it to come back."""


_ERRORS: dict[int, type[APIError]] = {401: Unauthorized, 404: NotFound, 409: Conflict, 422: InvalidRequest,
                                      503: Unavailable}


def _readable(detail: Any) -> str:
    if isinstance(detail, list):  # validation errors: the field path without its "body"/"query" root
        return "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in detail)
    return str(detail)


@dataclass(frozen=True)
class Event:
    """One Server-Sent Event of a run: `kind` is "status", "metrics" or "stall" (and "resumed" where a follower
    reconnected: what came meanwhile follows it)."""

    id: int
    kind: str
    data: dict[str, Any]


class Client:
    """A connection to one longrun server. Use as a context manager, or call close()."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0,
                 http: httpx.Client | None = None):
        """url and token default to LONGRUN_URL and LONGRUN_API_TOKEN; `http` sends through a given httpx
        client instead of a new one (FastAPI's TestClient, in tests); it stays open when this one closes."""
        self.url = url or os.environ.get("LONGRUN_URL", DEFAULT_URL)
        token = token if token is not None else os.environ.get("LONGRUN_API_TOKEN")
        self._owns_http = http is None
        self._http = http or httpx.Client(base_url=self.url, timeout=timeout)
        if token:
            self._http.headers["Authorization"] = f"Bearer {token}"
        # hears what the server chose for the caller (its Longrun-Note: a name that named several ended runs)
        self.on_note: Callable[[str], None] | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise ServerUnreachable(self.url) from None
        _raise_for(response)
        note = response.headers.get("Longrun-Note")
        if note and self.on_note is not None:
            self.on_note(note)
        return response.json() if response.content else None

    # runs

    def submit(self, spec: Mapping[str, Any] | bytes, idempotency_key: str | None = None,
               name_suffix: bool = False, start: str | None = None) -> dict[str, Any]:
        """Submit a run (a spec as in docs/api.md, or its JSON as bytes); with the same idempotency key and body,
        the run submitted first comes back. A name a live run has is a Conflict naming that run; with
        `name_suffix` the new run is named NAME-2 (the first NAME-N no run has) instead. `start` ("resume" or
        "fresh") says where a trainer run over another run's checkpoint starts."""
        headers = {"Content-Type": "application/json"}
        if idempotency_key:
            headers["Idempotency-Key"] = idempotency_key
        body = spec if isinstance(spec, bytes) else json.dumps(spec).encode()
        params = {"name_suffix": "true"} if name_suffix else {}
        if start:
            params["start"] = start
        return self._call("POST", "/v1/runs", content=body, headers=headers, params=params or None)

    def get(self, run_id: str) -> dict[str, Any]:
        """The run: status, attempt, progress, eta_seconds, latest metrics, every attempt."""
        return self._call("GET", f"/v1/runs/{run_id}")

    def list(self, status: str | None = None, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        """One page of runs, newest first: {"items": [...], "next_cursor": ...}."""
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = status
        if cursor:
            params["cursor"] = cursor
        return self._call("GET", "/v1/runs", params=params)

    def watch(self, run_id: str, interval: float = 1.0, reconnect_for: float = 600.0,
              on_reconnect: Callable[[str], None] | None = None) -> Iterator[dict[str, Any]]:
        """The run as it changes, until (and including) the snapshot where it has ended.

        Follows the run's event stream: a fresh snapshot on each status change at once, and on metric points
        at most every `interval` seconds. A server that goes away (restarted, say) is waited for up to
        `reconnect_for` seconds with backoff, and the stream resumes after the last event seen, so nothing
        that happened meanwhile is missed; `on_reconnect` hears each wait."""
        run = self.get(run_id)
        yield run
        if run["status"] in TERMINAL:
            return
        fetched, seen = time.monotonic(), None
        while True:
            for event in self.events(run_id, seen, reconnect_for=reconnect_for, on_reconnect=on_reconnect):
                seen = event.id or seen
                if event.kind in ("status", "resumed") or time.monotonic() - fetched >= interval:
                    run = self.through_restarts(lambda: self.get(run_id), reconnect_for, on_reconnect)
                    fetched = time.monotonic()
                    yield run
                    if run["status"] in TERMINAL:
                        return
            # the stream ended: the server closes it once the run has ended (else it was cut: follow on)
            run = self.through_restarts(lambda: self.get(run_id), reconnect_for, on_reconnect)
            if run["status"] in TERMINAL:
                yield run
                return

    def events(self, run_id: str, last_event_id: int | None = None, reconnect_for: float = 0.0,
               on_reconnect: Callable[[str], None] | None = None) -> Iterator[Event]:
        """The run's status changes and metric points as they are stored, until it ends (Server-Sent Events).

        With `reconnect_for` > 0 a dropped stream (a server restart) is reopened with backoff for up to that
        many seconds without an answer, from the last event id seen (Last-Event-ID), and an Event of kind
        `resumed` marks the seam."""
        seen, resumed = last_event_id, False
        while True:
            headers = {"Last-Event-ID": str(seen)} if seen is not None else {}
            try:
                # a plain tuple (connect, read, write, pool): `http` may be another httpx-compatible client (Starlette's
                # TestClient is httpx2's where that is installed), whose Timeout refuses httpx's
                connect = self._http.timeout.connect
                with httpx_sse.connect_sse(self._http, "GET", f"/v1/runs/{run_id}/events", headers=headers,
                                           timeout=(connect, 60.0, connect, connect)) as source:
                    response = source.response
                    if response.status_code >= 400:
                        response.read()
                        _raise_for(response)
                    if resumed:
                        yield Event(seen or 0, "resumed", {})
                        resumed = False
                    for sse in source.iter_sse():
                        if sse.id:
                            seen = int(sse.id)
                        yield Event(seen or 0, sse.event, json.loads(sse.data) if sse.data else {})
                    return
            except (httpx.TransportError, Unavailable, _ServerError) as exc:
                if reconnect_for <= 0:
                    if isinstance(exc, httpx.ConnectError):
                        raise ServerUnreachable(self.url) from None
                    raise
                self._wait_for_server(reconnect_for, on_reconnect)
                resumed = True

    def _wait_for_server(self, reconnect_for: float, on_reconnect: Callable[[str], None] | None) -> None:
        """Back off (0.25 s doubling to 5 s) until /healthz answers, for at most reconnect_for seconds."""
        if on_reconnect is not None:
            on_reconnect(f"lost the server at {self.url}; reconnecting for up to {reconnect_for:g}s")
        try:
            for attempt in tenacity.Retrying(wait=tenacity.wait_exponential(multiplier=0.25, max=5),
                                             stop=tenacity.stop_after_delay(reconnect_for), reraise=True,
                                             retry=tenacity.retry_if_exception_type((httpx.TransportError,
                                                                                     _ServerError))):
                with attempt:
                    response = self._http.get("/healthz", timeout=2.0)
                    if response.status_code >= 500:
                        raise _ServerError(response.status_code, response.text)
        except (httpx.TransportError, _ServerError):
            raise ServerUnreachable(self.url) from None

    def through_restarts(self, call: Callable[[], Any], reconnect_for: float = 600.0,
                         on_reconnect: Callable[[str], None] | None = None) -> Any:
        """call() (a request of this client's), waiting for the server to come back as `events` does when it
        cannot be reached."""
        try:
            return call()
        except (ServerUnreachable, httpx.TransportError, Unavailable, _ServerError):
            if reconnect_for <= 0:
                raise
        self._wait_for_server(reconnect_for, on_reconnect)
        return call()

    def cancel(self, run_id: str) -> dict[str, Any]:
        """Stop the run on every node; it goes to `cancelling`, then `cancelled` once nothing is left."""
        return self._call("POST", f"/v1/runs/{run_id}/cancel")

    def restart(self, run_id: str, overrides: Mapping[str, Any] | None = None, *, clean: bool = False,
                init_from_last: bool = False, dry_run: bool = False, resume: bool = False,
                **fields: Any) -> dict[str, Any]:
        """Relaunch as a new attempt with fields changed (`ttt_steps=5`, or `overrides={...}`); with dry_run,
        only the predicted duration of that attempt, nothing changed. A trainer's checkpoint of another TTT depth
        is resumed only with `resume` (else InvalidRequest; `clean` starts from step 0)."""
        body = {"overrides": {**(overrides or {}), **fields}, "clean": clean, "init_from_last": init_from_last}
        if resume:
            body["resume"] = True
        return self._call("POST", f"/v1/runs/{run_id}/restart", params={"dry_run": str(dry_run).lower()}, json=body)

    def delete(self, run_id: str) -> None:
        """Forget an ended run with its metrics, logs and events (Conflict while it has not ended)."""
        self._call("DELETE", f"/v1/runs/{run_id}")

    def metrics(self, run_id: str, names: list[str] | None = None, attempt: int | None = None,
                since_step: int | None = None, limit: int | None = None) -> dict[str, list[dict[str, Any]]]:
        """Time series by metric name: [{"attempt", "step", "value", "time"}, ...], each in step order. With `limit`,
        every point up to that many in all; without it the server thins each series (a name in one attempt) to 2000
        evenly spread points, its first and last kept. An answer holds at most METRICS_PAGE points: this follows
        the server's next_cursor until it has them all."""
        params: dict[str, Any] = {}
        if names:
            params["names"] = ",".join(names)
        if attempt is not None:
            params["attempt"] = attempt
        if since_step is not None:
            params["since_step"] = since_step
        series: dict[str, list[dict[str, Any]]] = {}
        left = limit
        while True:
            if left is not None:
                params["limit"] = min(left, METRICS_PAGE)
            page = self._call("GET", f"/v1/runs/{run_id}/metrics", params=params)
            for name, points in page["series"].items():
                series.setdefault(name, []).extend(points)
                if left is not None:
                    left -= len(points)
            if not page.get("next_cursor") or left == 0:
                return series
            params["cursor"] = page["next_cursor"]

    def logs(self, run_id: str, tail: int | None = None, attempt: int | None = None,
             since_offset: int | None = None, node: int = 0) -> dict[str, Any]:
        """Log lines of the current (or a given) attempt: {"attempt", "log_path", "lines", "next_offset", "more"}
        (`more`: a read from since_offset stopped at the answer's 1 MiB bound; read on from next_offset)."""
        params = {k: v for k, v in {"tail": tail, "attempt": attempt, "since_offset": since_offset}.items()
                  if v is not None}
        if node:
            params["node"] = node
        return self._call("GET", f"/v1/runs/{run_id}/logs", params=params)

    def traceback(self, run_id: str, rank: int, attempt: int | None = None) -> dict[str, Any]:
        """A failed rank's traceback: {"attempt", "node", "rank", "root_cause", "traceback"} (NotFound when that
        rank did not fail)."""
        params = {"rank": rank} | ({"attempt": attempt} if attempt is not None else {})
        return self._call("GET", f"/v1/runs/{run_id}/traceback", params=params)

    def evaluation(self, run_id: str) -> dict[str, Any]:
        """The acceptance report of the run's newest evaluated draft, with every attempt's in `by_attempt`."""
        return self._call("GET", f"/v1/runs/{run_id}/evaluation")

    def advice(self, run_id: str, interconnect: str | None = None, tp: int | None = None,
               attempt: int | None = None, deploy_host: str | None = None, engine: str | None = None,
               topk: int | None = None, draft_tp: int | None = None) -> dict[str, Any]:
        """Tokens/s per speculation depth, the depth to serve, and whether a deeper TTT retrain pays off; with
        deploy_host on the all-reduce table measured there (probe_interconnect), else on the built-in ones
        (nvlink, tp=8 unless given); with engine (sglang, vllm) the draft priced the way it runs it."""
        params = {k: v for k, v in {"interconnect": interconnect, "tp": tp, "attempt": attempt,
                                    "deploy_host": deploy_host, "engine": engine, "topk": topk,
                                    "draft_tp": draft_tp}.items() if v is not None}
        return self._call("GET", f"/v1/runs/{run_id}/advice", params=params)

    def proposal(self, run_id: str) -> dict[str, Any]:
        """The service's depth proposal: restart at a deeper TTT (with its dry run, GPU-hours and tokens/s on the
        spec's deploy host) or keep going, from the latest validation's sim_acc metrics."""
        return self._call("GET", f"/v1/runs/{run_id}/proposal")

    def take_probe(self, run_id: str) -> dict[str, Any]:
        """Take the probe the proposal offers: the checkpoint resumed at the candidate TTT for its N steps, decided
        at its validation (POST /v1/runs/{id}/proposal/probe; a 409 where none is offered)."""
        return self._call("POST", f"/v1/runs/{run_id}/proposal/probe")

    # hosts

    def hosts(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/hosts")

    def host(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/hosts/{name}")

    def add_host(self, name: str | None, address: str | None, workspace: str | None, **fields: Any) -> dict[str, Any]:
        """Register a host; fields: port, username, key_path, host_key, python. None values are left out, so
        the server names what is missing."""
        body = {"name": name, "address": address, "workspace": workspace, **fields}
        return self._call("POST", "/v1/hosts", json={k: v for k, v in body.items() if v is not None})

    def update_host(self, name: str, **fields: Any) -> dict[str, Any]:
        """Change a host's fields (address, port, username, key_path, workspace, host_key, python); a field given
        as None is cleared (username, key_path, host_key)."""
        return self._call("PATCH", f"/v1/hosts/{name}", json=fields)

    def delete_host(self, name: str) -> None:
        """Forget a host (Conflict while a run that has not ended uses it)."""
        self._call("DELETE", f"/v1/hosts/{name}")

    def host_gpus(self, name: str, max_age: float | None = None, wait: float | None = None) -> dict[str, Any]:
        """The host's GPUs and the processes on them, asking the worker for a fresh look when older than max_age."""
        params = {k: v for k, v in {"max_age": max_age, "wait": wait}.items() if v is not None}
        return self._call("GET", f"/v1/hosts/{name}/gpus", params=params)

    def probe_interconnect(self, name: str, tp: int | None = None, timeout: float = 900.0,
                           interval: float = 1.0) -> dict[str, Any]:
        """Measure NCCL all-reduce times on the host's GPUs (tp of them; None: all) and wait for the table; the
        answer's `status` is `measured` or `failed` (`message` says why), or still `pending` after `timeout`."""
        self._call("POST", f"/v1/hosts/{name}/interconnect", json={"tp": tp} if tp is not None else {})
        deadline = time.monotonic() + timeout
        while True:
            table = self.interconnect(name)
            if table["status"] != "pending" or time.monotonic() >= deadline:
                return table
            time.sleep(interval)

    def probe_verifier(self, name: str, config: str, tp: int, ep: int = 1, timeout: float = 1200.0,
                       interval: float = 1.0) -> dict[str, Any]:
        """Time one decoder layer of the verifier whose config.json (or model directory) is `config` on the host, one
        rank's share at tp (experts over ep ranks), and wait for the times; the answer's `status` is `measured` or
        `failed` (`message` says why), or still `pending` after `timeout`."""
        self._call("POST", f"/v1/hosts/{name}/verifier", json={"config": config, "tp": tp, "ep": ep})
        deadline = time.monotonic() + timeout
        while True:
            probe = self._call("GET", f"/v1/hosts/{name}/verifier")
            if probe["status"] != "pending" or time.monotonic() >= deadline:
                return probe
            time.sleep(interval)

    def interconnect(self, name: str) -> dict[str, Any]:
        """The host's measured all-reduce table and the state of its newest probe."""
        return self._call("GET", f"/v1/hosts/{name}/interconnect")

    def health(self) -> bool:
        return self._call("GET", "/healthz").get("status") == "ok"


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text}
    detail = body.get("detail") if isinstance(body, dict) else body
    error = _ERRORS.get(response.status_code, _ServerError if response.status_code >= 500 else APIError)
    if error is Conflict:
        raise Conflict(response.status_code, detail, body.get("status"))
    raise error(response.status_code, detail)
