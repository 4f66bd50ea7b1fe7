"""Host commands and queries: registration, lookup, and asking the worker for a fresh GPU snapshot."""

import sys

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.config import Settings
from server.errors import Conflict, NotFound, Unavailable
from server.models import Host, utcnow
from server.schemas import HostCreate
from server.wakeup import wake_workers


def register_host(session: Session, spec: HostCreate) -> Host:
    if session.scalar(select(Host).where(Host.name == spec.name)) is not None:
        raise Conflict(f"a host named {spec.name!r} exists already")
    host = Host(**spec.model_dump())
    session.add(host)
    session.flush()
    return host


def get_host(session: Session, name: str) -> Host:
    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        raise NotFound(f"no host named {name!r}")
    return host


def list_hosts(session: Session) -> list[Host]:
    return list(session.scalars(select(Host).order_by(Host.name)))


def ensure_local_host(session: Session, settings: Settings) -> Host:
    """The `local` host: this machine, with its workspace under LONGRUN_HOME, run by this Python."""
    host = session.scalar(select(Host).where(Host.name == "local"))
    if host is None:
        host = Host(name="local", address="local", port=0, workspace=str(settings.local_workspace),
                    python=sys.executable)
        session.add(host)
    elif host.address == "local":
        host.python = sys.executable
    settings.local_workspace.mkdir(parents=True, exist_ok=True)
    return host


def request_gpu_snapshot(session: Session, name: str, max_age: float) -> bool:
    """True when the host's snapshot is at most max_age seconds old; else flags it for the worker and says False."""
    host = get_host(session, name)
    if host.gpu_snapshot_at and (utcnow() - host.gpu_snapshot_at).total_seconds() <= max_age:
        return True
    host.gpu_wanted_at = utcnow()
    wake_workers(session)
    return False


def gpu_snapshot_answered(session: Session, name: str) -> bool:
    """Whether the worker has answered the last request_gpu_snapshot (it clears the flag when it has)."""
    return get_host(session, name).gpu_wanted_at is None


def gpu_snapshot(session: Session, name: str) -> Host:
    """The host with its last GPU snapshot; Unavailable while it has none."""
    host = get_host(session, name)
    if host.gpu_snapshot is None:
        raise Unavailable(f"no GPU snapshot of {name} yet: {host.last_error or 'the worker has not answered'}")
    return host
