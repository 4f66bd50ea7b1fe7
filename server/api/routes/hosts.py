import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response, status
from starlette.concurrency import run_in_threadpool

from server import hosts, views
from server.api.deps import DB, ReadSession, WriteSession, write_line
from server.schemas import (
    GpuSnapshotPublic,
    HostCreate,
    HostPublic,
    HostUpdate,
    InterconnectProbeCreate,
    InterconnectPublic,
)

router = APIRouter(prefix="/hosts", tags=["hosts"])

# how often a waiting GPU request looks whether the worker has answered
GPU_POLL_SECONDS = 0.2


@router.post("", status_code=status.HTTP_201_CREATED)
def register_host(body: HostCreate, session: WriteSession) -> HostPublic:
    return views.host_public(hosts.register_host(session, body))


@router.get("")
def list_hosts(session: ReadSession) -> list[HostPublic]:
    return [views.host_public(h) for h in hosts.list_hosts(session)]


@router.get("/{name}")
def get_host(name: str, session: ReadSession) -> HostPublic:
    return views.host_public(hosts.get_host(session, name))


@router.patch("/{name}", responses={404: {"description": "no such host"},
                                   409: {"description": "a new workspace while a run uses the host"}})
def update_host(name: str, body: HostUpdate, session: WriteSession) -> HostPublic:
    """Change the fields given (host key, address, port, username, key path, workspace, python); the worker's
    next connection uses them. A run waiting on the host (a refused key, say) is retried with them."""
    return views.host_public(hosts.update_host(session, name, body))


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
