"""Stopping a node: SIGTERM to every process of it, SIGKILL to what is left after the grace, and the check that
nothing remains; the sweep of what a finished job or a dead wrapper left behind."""

import os
import signal
import time

from .containment import kill_cgroup, node_members, read_containment, release_cgroup, remove_cgroup
from .files import EXIT_FILE, STOP_FILE, read, write_exit_code
from .procfs import stat_fields

# how long a probe gives what is left of an attempt whose job is over (or whose wrapper died) before SIGKILL
LOST_GRACE = 5.0


def sweep(d, wrapper):
    """Nothing of an attempt runs on once its job is over: a wrapper found dead without an exit code (killed, or
    the OOM killer) left the whole job unwatched, and a job that ended may have left a helper running. Both are
    stopped before the node is answered; `remaining` names what would not stop."""
    token = read(os.path.join(d, "token"))
    if not (node_members(d, token) - {wrapper}):
        cgroup = read_containment(d)["cgroup"]
        if cgroup:
            release_cgroup(cgroup)
        return {"stopped": [], "remaining": []}
    stopped = stop_attempt(d, LOST_GRACE, record_exit=False)
    return {"stopped": stopped["signalled"], "remaining": stopped["remaining"]}


def _signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(d, token, seconds, wrapper=None):
    """Whether every process of the attempt is gone within `seconds`; looked at often at first (a job that honours
    SIGTERM is gone in milliseconds), then every 50 ms (each look reads /proc). `wrapper`, the attempt's wrapper
    pid, when it was just sent SIGTERM: a torchrun whose workers have all exited is not waited for (_cut_launcher)."""
    deadline = time.time() + seconds
    pause = 0.002
    while True:
        members = node_members(d, token)
        if not members:
            return True
        if wrapper is not None:
            _cut_launcher(d, members, wrapper)
        if time.time() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _cut_launcher(d, members, wrapper):
    """On a stop, once torchrun's workers are gone, all torchrun has left to do is finalize torch: about 0.5 s of
    CPU that would only delay the stop. The exit code is recorded first as a SIGTERM's (143), so the attempt
    reads as stopped on request, not as SIGKILLed (137) though its job stopped cleanly."""
    rest = members - {wrapper}
    if len(rest) != 1:
        return
    launcher = next(iter(rest))
    try:
        parent = int(stat_fields(launcher)[1])
        with open(f"/proc/{launcher}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except (OSError, TypeError, ValueError, IndexError):
        return
    if parent == wrapper and b"torch.distributed.run" in argv:
        write_exit_code(d, 128 + signal.SIGTERM)
        _signal_all([launcher], signal.SIGKILL)


def stop_attempt(d, grace, record_exit=True):
    """SIGTERM every process of the attempt (cgroup, session, token carriers), wait `grace`, kill what is left
    (the whole cgroup at once), and verify that nothing remains."""
    token = read(os.path.join(d, "token"))
    if token is None:
        return {"remaining": [], "signalled": [], "exit_code": None}
    try:
        with open(os.path.join(d, STOP_FILE), "a"):
            pass
    except OSError:  # a full disk must not stop a stop; only a wrapper still starting would miss it
        pass
    cgroup = read_containment(d)["cgroup"]
    signalled = sorted(node_members(d, token))
    _signal_all(signalled, signal.SIGTERM)
    wrapper = read(os.path.join(d, "pid"))
    if not _wait_gone(d, token, grace, int(wrapper) if wrapper else None):
        if cgroup:
            kill_cgroup(cgroup)
        _signal_all(node_members(d, token), signal.SIGKILL)
        _wait_gone(d, token, 5)
    remaining = sorted(node_members(d, token))
    if cgroup and not remaining:
        remove_cgroup(cgroup)
    if record_exit:
        write_exit_code(d, 137)  # kept only when the wrapper died without recording one
    code = read(os.path.join(d, EXIT_FILE))
    return {"remaining": remaining, "signalled": signalled, "exit_code": int(code) if code else None}
