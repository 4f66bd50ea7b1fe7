"""Host commands and queries: registration, lookup, asking the worker for a fresh GPU snapshot, an
interconnect probe or a verifier probe, and the measured all-reduce table the advisor uses for a deployment host."""

import os
import sys
import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.advisor.tables import Table
from server.config import Settings
from server.errors import Conflict, FieldError, NotFound, Unavailable
from server.layout import PYTHON_UNFIT, workspace_refusal
from server.lifecycle import ACTIVE
from server.models import Host, Run, utcnow
from server.schemas import HostCreate, HostUpdate
from server.wakeup import wake_workers

# what update_host resets as learnt over the old settings (restored with them when a change is undone)
LEARNT = ("workspace_real", "reachable", "last_error")


def check_workspace(host: Host) -> None:
    """Resolve a workspace on this machine (the `local` address) now, and refuse one whose real path is the root or
    a system directory; a remote host's is resolved there by the worker (workspace_real stays None until then)."""
    host.workspace_real = None
    if host.address != "local":
        return
    try:
        real = os.path.realpath(host.workspace)
    except OSError as exc:  # a component the server may not read (/proc/1/root for a user that is not root)
        raise FieldError(("workspace",), f"workspace {host.workspace!r} cannot be resolved on this machine: "
                         f"{exc.strerror or exc}; give a directory the server's user may read") from None
    if (why := workspace_refusal(host.workspace, real)) is not None:
        raise FieldError(("workspace",), why)
    host.workspace_real = real


def register_host(session: Session, spec: HostCreate) -> Host:
    if session.scalar(select(Host).where(Host.name == spec.name)) is not None:
        raise Conflict(f"a host named {spec.name!r} exists already")
    host = Host(**spec.model_dump())
    check_workspace(host)
    session.add(host)
    if host.workspace_real is None:
        wake_workers(session)  # a worker resolves the workspace on the host
    session.flush()
    return host


def workspace_resolved(session: Session, name: str) -> bool:
    """Whether the host's workspace is resolved on the host, or the worker could not reach it to ask (or it is
    gone): what registration waits for."""
    host = session.scalar(select(Host).where(Host.name == name))
    return host is None or host.workspace_real is not None or host.reachable is False


def refused_on_host(session: Session, name: str, undo: dict[str, Any] | None) -> FieldError | None:
    """The 422 for a host whose workspace its host resolved to a refused path, its registration undone (`undo`
    None: the host forgotten, unless a run goes there already) or its change (`undo`: the fields before); to be
    raised once this transaction has committed."""
    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        return None
    if host.reachable is False and (host.last_error or "").startswith(PYTHON_UNFIT):
        # the host answered, and its python cannot run the agent: nothing was written there
        field, why = "python", host.last_error[len(PYTHON_UNFIT):]
    elif host.workspace_real is None:
        return None
    else:
        field, why = "workspace", workspace_refusal(host.workspace, host.workspace_real)
    if why is None:
        return None
    if undo is None and not runs_using(session, name):
        session.delete(host)
    elif undo is not None:
        for attribute, value in undo.items():
            setattr(host, attribute, value)
    return FieldError((field,), why)


def runs_using(session: Session, name: str) -> list[Run]:
    """The runs not yet ended that go to host `name`."""
    active = session.scalars(select(Run).where(Run.status.in_(ACTIVE)).order_by(Run.created_at))
    return [r for r in active if name in (r.hosts or [])]


def _in_use(runs: list[Run]) -> str:
    return ", ".join(f"{r.name} [{r.id}] ({r.status})" for r in runs[:5]) + (" and more" if len(runs) > 5 else "")


def update_host(session: Session, name: str, change: HostUpdate) -> Host:
    """Change how the host is reached (a new key, address, user, key, port) or its python; the worker's next
    connection uses the new settings. The workspace holds the files of the runs under way there: it changes
    only while no run uses the host."""
    host = get_host(session, name)
    fields = change.model_dump(exclude_unset=True)
    if "workspace" in fields and fields["workspace"] != host.workspace and (using := runs_using(session, name)):
        raise Conflict(f"{name}'s workspace holds the files of {_in_use(using)}: change it once they have ended "
                       f"(`longrun cancel RUN`)")
    for field, value in fields.items():
        setattr(host, field, value)
    if fields.keys() - {"python"}:
        # what was learnt over the old settings says nothing about the new ones
        host.reachable, host.last_error = None, None
        check_workspace(host)
    wake_workers(session)
    session.flush()
    return host


def delete_host(session: Session, name: str) -> None:
    """Forget the host; refused while a run that has not ended goes there. Nothing on the host is touched."""
    host = get_host(session, name)
    if using := runs_using(session, name):
        raise Conflict(f"{name} is used by {_in_use(using)}: cancel them first (`longrun cancel RUN`)")
    session.delete(host)


def unknown_host(name: str) -> str:
    """What a host name no host has is told: the command that registers it, and the one that lists those there are."""
    return (f"no host named {name!r}: register it with `longrun hosts add {name} --address ADDRESS --username USER "
            "--key-path KEY --workspace DIR --python PYTHON` (POST /v1/hosts); `longrun hosts list` shows the hosts")


def get_host(session: Session, name: str) -> Host:
    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        raise NotFound(unknown_host(name))
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


def _known_gpu_count(host: Host) -> int | None:
    snapshot = host.gpu_snapshot or {}
    return len(snapshot.get("gpus") or []) if snapshot.get("available") else None


def request_interconnect_probe(session: Session, name: str, tp: int | None) -> Host:
    """Flag the host for the worker's all-reduce sweep at tp ranks (None: every GPU); refused when the host's
    last GPU snapshot has fewer GPUs than tp, or while a probe at another tp is under way."""
    host = get_host(session, name)
    known = _known_gpu_count(host)
    if tp is not None and known is not None and known < tp:
        raise Conflict(f"{name} has {known} GPU(s) (nvidia-smi at {host.gpu_snapshot_at:%Y-%m-%d %H:%M} UTC); an "
                       f"all-reduce at tp={tp} needs {tp}: probe with tp <= {known}, or a host with {tp} GPUs")
    wanted = tp or 0
    if host.interconnect_wanted_tp is not None and host.interconnect_wanted_tp != wanted:
        under_way = host.interconnect_wanted_tp or "every GPU"
        raise Conflict(f"a probe of {name} at tp={under_way} is under way: wait for it, then ask again")
    host.interconnect_wanted_tp, host.interconnect_error = wanted, None
    wake_workers(session)
    return host


def _probe_status(wanted: Any, error: str | None, measured: bool) -> str:
    """A probe's state: pending while asked for, failed when the newest did not measure, else whether one has."""
    if wanted is not None:
        return "pending"
    if error:
        return "failed"
    return "measured" if measured else "not_measured"


def interconnect_status(host: Host) -> str:
    # host.interconnect may hold only the verifier probe's layer times (no table yet)
    return _probe_status(host.interconnect_wanted_tp, host.interconnect_error,
                         "allreduce" in (host.interconnect or {}))


def request_verifier_probe(session: Session, name: str, config: str, tp: int, ep: int) -> Host:
    """Flag the host for the worker's verifier probe (worker/verifier_probe.py: one decoder layer of the verifier
    whose config.json is `config` there, one rank's share at tp, experts over ep ranks, timed at 1..16 tokens on its
    GPU 0); refused when the host's last GPU snapshot shows no GPU, or while a probe of another is under way."""
    host = get_host(session, name)
    snapshot = host.gpu_snapshot or {}
    if host.gpu_snapshot is not None and not (snapshot.get("available") and snapshot.get("gpus")):
        why = snapshot.get("message") or "nvidia-smi lists none"
        raise Conflict(f"no GPU on {name} (nvidia-smi at {host.gpu_snapshot_at:%Y-%m-%d %H:%M} UTC: {why}): the "
                       "verifier probe times a layer on the deploy host's GPU; probe a host with one")
    wanted = {"config": config, "tp": tp, "ep": ep}
    if host.verifier_wanted is not None and host.verifier_wanted != wanted:
        under_way = host.verifier_wanted
        raise Conflict(f"a verifier probe of {name} ({under_way.get('config')} at tp={under_way.get('tp')}, "
                       f"ep={under_way.get('ep')}) is under way: wait for it, then ask again")
    host.verifier_wanted, host.verifier_error = wanted, None
    wake_workers(session)
    return host


def verifier_status(host: Host) -> str:
    return _probe_status(host.verifier_wanted, host.verifier_error, bool((host.interconnect or {}).get("verifier")))


def measured_allreduce(session: Session, name: str, tp: int | None) -> tuple[int, str | None, Table, str]:
    """(tp, interconnect, table, basis) measured on host `name` for advice at tp (None: the measured tp).

    A table is used only at the tp it was measured with: at another tp it would be an extrapolation presented
    as a measurement, so that is a Conflict saying what to probe. tp=1 needs no all-reduce."""
    host = get_host(session, name)
    measured = host.interconnect
    if not measured or "allreduce" not in measured:
        why = f" (the last probe failed: {host.interconnect_error})" if host.interconnect_error else ""
        raise Conflict(f"{name} has no measured all-reduce table{why}: run `longrun hosts probe-interconnect "
                       f"{name}`, or leave out deploy_host for the built-in defaults")
    if tp is None:
        tp = measured["tp"]
    if tp != 1 and tp != measured["tp"]:
        raise Conflict(f"{name}'s all-reduce was measured at tp={measured['tp']} ({measured.get('gpu_count')} GPUs "
                       f"there); advice at tp={tp} would extrapolate it: probe a host with {tp} GPUs "
                       f"(`longrun hosts probe-interconnect HOST --tp {tp}`), or leave out deploy_host")
    table = tuple((row["bytes"], row["us"]) for row in measured["allreduce"])
    basis = (f"measured on {name} by probe-interconnect at {measured['measured_at']}: NCCL all-reduce over "
             f"{measured['tp']} GPUs ({', '.join(sorted(set(measured.get('gpus') or []))) or 'unnamed'}), "
             f"links {measured.get('interconnect') or 'unknown (nvidia-smi topo -m unreadable)'}"
             + (f", with {measured['nccl_env']}" if measured.get("nccl_env") else ""))
    return tp, measured.get("interconnect"), table, basis


# path checks a host holds at once (more are not asked: their submits go on unchecked, the launch finds out)
MAX_PATH_CHECKS = 64


def request_path_check(session: Session, name: str, paths: list[str]) -> str | None:
    """Ask the worker what `paths` are on host `name` (all of a host's questions go in one call); the id to read the
    answer by, or None for a host there is none of, a Slurm host (its compute nodes may see other files than its
    login node) or one with too many questions pending."""
    host = session.scalars(select(Host).where(Host.name == name).with_for_update()).first()
    if host is None or host.kind == "slurm" or len(host.paths_wanted or {}) >= MAX_PATH_CHECKS:
        return None
    ident = uuid.uuid4().hex
    host.paths_wanted = {**(host.paths_wanted or {}), ident: paths}
    wake_workers(session)
    return ident


def path_check_answer(session: Session, name: str, ident: str) -> dict[str, Any] | None:
    """{path: "dir" | "file" | None} as the host answered request `ident`, {"error": why}, or None until then."""
    host = session.scalar(select(Host).where(Host.name == name))
    found = (host.paths_found or {}).get(ident) if host is not None else None
    return found if isinstance(found, dict) else None
