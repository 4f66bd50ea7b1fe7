"""Host registration and lookup."""

import sys

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.config import Settings
from server.models import Host
from server.runs import Conflict, NotFound
from server.schemas import HostCreate, HostPublic


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


def host_public(host: Host) -> HostPublic:
    return HostPublic(name=host.name, address=host.address, port=host.port, username=host.username,
                      workspace=host.workspace, python=host.python, reachable=host.reachable,
                      last_seen_at=host.last_seen_at, last_error=host.last_error, gpus=host.gpu_snapshot,
                      gpus_sampled_at=host.gpu_snapshot_at)
