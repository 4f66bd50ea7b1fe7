"""The workspace check: a host's workspace resolved on the host, its symlinks followed there, before anything is
written under it (the host agent is installed there): one that leads to / or a system directory is refused. The
connection warmer asks at its first contact, which registration waits for (a 422); a host not reached then is
checked at its first launch, which fails the run naming the workspace. The real path found then is what the host
agent is told with every request: at each launch and clean (and before it installs itself) it resolves the
workspace again on the host and refuses, writing nothing, when it leads elsewhere (swapped for a symlink since)."""

from server.db import Database
from server.layout import PYTHON_UNFIT, workspace_refusal
from server.models import Host
from worker.host_agent import PythonUnfit
from worker.host_contact import HostContact
from worker.host_errors import CommandFailed, HostError
from worker.transport_pool import settings_of


def reached_with(host: Host) -> tuple:
    """What reaching the host and its workspace depends on: a check is made again when it changes."""
    return (*settings_of(host), host.workspace, host.python)


def resolve(db: Database, contact: HostContact, host: Host) -> str:
    """The real path of the host's workspace: as stored, else asked on the host and stored (unless the host
    changed meanwhile)."""
    if host.workspace_real is not None:
        return host.workspace_real
    try:
        real = contact.agent(host).workspace_real()
    except CommandFailed as exc:
        if not isinstance(exc, PythonUnfit):
            # the host's python ran and answered something else than the few lines it was given print (a shim
            # printing junk and exiting 1): that python is unfit, as one not found is, whatever it printed
            exc = PythonUnfit(f"{PYTHON_UNFIT}the host's python {host.python!r} did not answer as a Python does "
                              f"({str(exc)[:300]}); register the host with --python naming a Python 3.8 or newer "
                              f"(longrun hosts update {host.name} --python /path/to/python3)", host.name)
        exc.host = exc.host or host.name
        raise exc from None
    except HostError as exc:
        exc.host = exc.host or host.name
        raise
    reached = contact.transports.destination(host.name)
    with db.writing() as s:
        fresh = s.get(Host, host.id)
        if fresh is not None and reached_with(fresh) == reached_with(host):
            fresh.workspace_real = real
            fresh.reached = reached[:512] if reached else fresh.reached
    return real


def refuse_workspace(db: Database, contact: HostContact, host: Host) -> None:
    """Raise CommandFailed (the run fails with it) when the host's workspace leads to / or a system directory.
    `host` learns its real path, so that the agent made for it next is told it: the agent checks on the host, at
    every call that writes, that the workspace still leads there (worker/hostside/files.py workspace_moved)."""
    host.workspace_real = resolve(db, contact, host)
    why = workspace_refusal(host.workspace, host.workspace_real)
    if why is not None:
        raise CommandFailed(f"host {host.name}: {why} (longrun hosts update {host.name} --workspace DIR)", host.name)


def check_workspace(db: Database, contact: HostContact, host: Host, failed: HostError | None = None) -> None:
    """Resolve a host's workspace on the host now (the connection warmer, at its first contact); a host not reached
    (or whose first connect `failed` already: a second try would only take the connect's time again) is marked so,
    which ends registration's wait (its first launch asks again). A port that refuses and one that accepts and
    stays silent thus end the wait alike, each after one connect's time at most: no port oracle."""
    if failed is None:
        try:
            resolve(db, contact, host)
        except HostError as exc:
            failed = exc
    if failed is not None:
        with db.writing() as s:
            fresh = s.get(Host, host.id)
            if fresh is not None and reached_with(fresh) == reached_with(host):
                fresh.reachable, fresh.last_error = False, str(failed)
