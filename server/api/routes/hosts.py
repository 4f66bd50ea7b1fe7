import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from server import hosts
from server.api.deps import DB, ReadSession, WriteSession
from server.models import utcnow
from server.schemas import GpuSnapshotPublic, HostCreate, HostPublic

router = APIRouter(prefix="/hosts", tags=["hosts"])


@router.post("", status_code=status.HTTP_201_CREATED)
def register_host(body: HostCreate, session: WriteSession) -> HostPublic:
    return hosts.host_public(hosts.register_host(session, body))


@router.get("")
def list_hosts(session: ReadSession) -> list[HostPublic]:
    return [hosts.host_public(h) for h in hosts.list_hosts(session)]


@router.get("/{name}")
def get_host(name: str, session: ReadSession) -> HostPublic:
    return hosts.host_public(hosts.get_host(session, name))


@router.get("/{name}/gpus")
def host_gpus(name: str, db: DB, max_age: Annotated[float, Query(ge=0, le=3600)] = 10.0,
              wait: Annotated[float, Query(ge=0, le=60)] = 15.0) -> GpuSnapshotPublic:
    """The host's GPUs, processes included; asks the worker for a new snapshot when the last is older than max_age."""
    with db.writing() as s:
        host = hosts.get_host(s, name)
        fresh = host.gpu_snapshot_at and (utcnow() - host.gpu_snapshot_at).total_seconds() <= max_age
        if not fresh:
            host.gpu_wanted_at = utcnow()
    deadline = time.monotonic() + wait
    while not fresh and time.monotonic() < deadline:
        time.sleep(0.2)
        with db.reading() as s:
            host = hosts.get_host(s, name)
            fresh = host.gpu_wanted_at is None
    if host.gpu_snapshot is None:
        raise HTTPException(503, f"no GPU snapshot of {name} yet: {host.last_error or 'the worker has not answered'}")
    return GpuSnapshotPublic(host=name, sampled_at=host.gpu_snapshot_at, reachable=host.reachable,
                             **host.gpu_snapshot)
