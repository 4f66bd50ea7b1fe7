import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from starlette.concurrency import run_in_threadpool

from server import hosts, views
from server.api.deps import DB, ReadSession, WriteSession, write_line
from server.db import Database
from server.errors import FieldError
from server.schemas import (
    GpuSnapshotPublic,
    HostCreate,
    HostPublic,
    HostUpdate,
    InterconnectProbeCreate,
    InterconnectPublic,
    VerifierProbeCreate,
    VerifierProbePublic,
)
from server.wakeup import workers_listening

router = APIRouter(prefix="/hosts", tags=["hosts"])

# how often a waiting GPU request looks whether the worker has answered
GPU_POLL_SECONDS = 0.2
# how long a registration waits for a worker to resolve a remote host's workspace there, past the worker's own
# deadline for a connect (LONGRUN_SSH_CONNECT_TIMEOUT): a host the worker cannot reach (a closed port, or one that
# accepts and stays silent until that deadline) is answered reachable: false, whichever it was
WORKSPACE_WAIT_SECONDS = 20.0


@router.post("", status_code=status.HTTP_201_CREATED,
             responses={422: {"description": "a bad field, or a workspace that leads to / or a system directory on "
                                             "the host (its symlinks followed there)"}})
async def register_host(body: HostCreate, request: Request, db: DB) -> HostPublic:
    """Register a host. A remote host's workspace is resolved on the host by a worker: registration waits for it (a
    few seconds, while a worker listens) and refuses, 422, one that leads to / or a system directory; a host not
    reached by then is checked at its first contact, before anything is written under its workspace."""

    def register() -> bool:
        with db.writing() as s:
            return hosts.register_host(s, body).workspace_real is None

    async with write_line(request.app):
        pending = await run_in_threadpool(register)
    return await _resolved_on_host(request, db, body.name, None, pending)


@router.get("")
def list_hosts(session: ReadSession) -> list[HostPublic]:
    return [views.host_public(h) for h in hosts.list_hosts(session)]


@router.get("/{name}")
def get_host(name: str, session: ReadSession) -> HostPublic:
    return views.host_public(hosts.get_host(session, name))


@router.patch("/{name}", responses={404: {"description": "no such host"},
                                   409: {"description": "a new workspace while a run uses the host"}})
async def update_host(name: str, body: HostUpdate, request: Request, db: DB) -> HostPublic:
    """Change the fields given (host key, address, port, username, key path, workspace, python); the worker's
    next connection uses them. A run waiting on the host (a refused key, say) is retried with them. A changed
    remote host is resolved on the host again, as at registration: a workspace that leads to / or a system
    directory there is a 422 and the change is undone."""

    def update() -> tuple[bool, dict[str, Any]]:
        with db.writing() as s:
            before = hosts.get_host(s, name)
            undo = {field: getattr(before, field) for field in (*body.model_fields_set, *hosts.LEARNT)}
            return hosts.update_host(s, name, body).workspace_real is None, undo

    async with write_line(request.app):
        pending, undo = await run_in_threadpool(update)
    return await _resolved_on_host(request, db, name, undo, pending)


async def _resolved_on_host(request: Request, db: Database, name: str, undo: dict[str, Any] | None,
                            pending: bool) -> HostPublic:
    """The host once a worker has resolved its workspace on it, or could not reach it, or WORKSPACE_WAIT_SECONDS
    have passed (no wait where no worker listens); a refused workspace undoes the write (`undo`) and is a 422."""

    def resolved() -> bool:
        with db.reading() as s:
            return hosts.workspace_resolved(s, name)

    def refused() -> FieldError | None:
        with db.writing() as s:
            return hosts.refused_on_host(s, name, undo)

    def shown() -> HostPublic:
        with db.reading() as s:
            return views.host_public(hosts.get_host(s, name))

    if pending and await run_in_threadpool(workers_listening, db.engine):
        deadline = time.monotonic() + request.app.state.settings.ssh_connect_timeout + WORKSPACE_WAIT_SECONDS
        while not await run_in_threadpool(resolved) and time.monotonic() < deadline:
            await asyncio.sleep(GPU_POLL_SECONDS)
        async with write_line(request.app):
            error = await run_in_threadpool(refused)
        if error is not None:
            raise error
    return await run_in_threadpool(shown)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT,
               responses={404: {"description": "no such host"}, 409: {"description": "a run that has not ended uses it"}})
def delete_host(name: str, session: WriteSession) -> Response:
    """Forget the host (409 while a run that has not ended goes there); nothing on the host is touched."""
    hosts.delete_host(session, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{name}/gpus", responses={503: {"description": "no snapshot of this host yet"}})
async def host_gpus(name: str, request: Request, db: DB, max_age: Annotated[float, Query(ge=0, le=3600)] = 10.0,
                    wait: Annotated[float, Query(ge=0, le=60)] = 15.0) -> GpuSnapshotPublic:
    """The host's GPUs, processes included; asks the worker for a new snapshot when the last is older than max_age
    and waits up to `wait` seconds for it (without holding a thread: many may wait at once)."""

    def ask() -> bool:
        with db.writing() as s:
            return hosts.request_gpu_snapshot(s, name, max_age)

    def answered() -> bool:
        with db.reading() as s:
            return hosts.gpu_snapshot_answered(s, name)

    def snapshot() -> GpuSnapshotPublic:
        with db.reading() as s:
            return views.gpu_snapshot_public(hosts.gpu_snapshot(s, name))

    async with write_line(request.app):
        fresh = await run_in_threadpool(ask)
    deadline = time.monotonic() + wait
    while not fresh and time.monotonic() < deadline:
        await asyncio.sleep(GPU_POLL_SECONDS)
        fresh = await run_in_threadpool(answered)
    return await run_in_threadpool(snapshot)


@router.post("/{name}/interconnect", status_code=status.HTTP_202_ACCEPTED,
             responses={404: {"description": "no such host"},
                        409: {"description": "fewer GPUs than tp, or a probe at another tp under way"}})
def probe_interconnect(name: str, session: WriteSession, body: InterconnectProbeCreate | None = None) -> InterconnectPublic:
    """Ask the worker to measure NCCL all-reduce times by message size on the host's GPUs (and read
    `nvidia-smi topo -m`); GET the same path until `status` is no longer `pending`."""
    tp = body.tp if body else None
    return views.interconnect_public(hosts.request_interconnect_probe(session, name, tp))


@router.get("/{name}/interconnect", responses={404: {"description": "no such host"}})
def get_interconnect(name: str, session: ReadSession) -> InterconnectPublic:
    """The host's measured all-reduce table, which GET /v1/runs/{id}/advice?deploy_host=NAME uses."""
    return views.interconnect_public(hosts.get_host(session, name))


@router.post("/{name}/verifier", status_code=status.HTTP_202_ACCEPTED,
             responses={404: {"description": "no such host"},
                        409: {"description": "no GPU on the host by its GPU snapshot, or a probe of another "
                                             "verifier, tp or ep under way"}})
def probe_verifier(name: str, body: VerifierProbeCreate, session: WriteSession) -> VerifierProbePublic:
    """Ask the worker to time one decoder layer of the verifier whose config.json is `config` on the host (one
    rank's share at tp, random weights of its dtype, 1..16 query tokens, on its GPU 0); stored beside the host's
    all-reduce table, the proposal of a run deployed there prices the verifier's forward from it. GET the same path
    until `status` is no longer `pending`."""
    return views.verifier_probe_public(hosts.request_verifier_probe(session, name, body.config, body.tp, body.ep))


@router.get("/{name}/verifier", responses={404: {"description": "no such host"}})
def get_verifier(name: str, session: ReadSession) -> VerifierProbePublic:
    """The verifier layer times measured on the host and the state of its newest probe."""
    return views.verifier_probe_public(hosts.get_host(session, name))
