"""Containment: the layers that hold an attempt's processes (a systemd scope, a cgroup of its own, its session),
what the wrapper recorded of its layer, and every live process of a node."""

import hashlib
import json
import os
import shutil
import time

from .files import CONTAINMENT_FILE, read, write_atomic
from .procfs import cgroup2_mount, cgroup_of, cgroup_pids, node_carriers, session_members, start_time

CONTAINMENT_VAR = "LONGRUN_CONTAINMENT"


def unit_name(token, d):
    # cgroup names are world-readable: name the attempt's node by a digest, never by its token
    return "longrun-" + hashlib.sha256(f"{token}\0{d}".encode()).hexdigest()[:16]


def systemd_scope(unit):
    """The argv prefix that starts the wrapper in a transient systemd scope, or None where systemd does not run
    on a cgroup v2 hierarchy (the scope is then killed and checked through its cgroup directory)."""
    tool = shutil.which("systemd-run")
    if not os.path.isdir("/run/systemd/system") or tool is None or cgroup2_mount() is None:
        return None
    user = ["--user"] if os.getuid() != 0 else []
    return [tool, *user, "--scope", "--quiet", "--collect", f"--unit={unit}.scope", "--"]


def new_cgroup(unit):
    """A cgroup v2 directory of the attempt's own, under ours, or None when we may not make one."""
    ours = cgroup_of()
    if ours is None:
        return None
    path = os.path.join(ours, unit)
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError:
        return None
    if os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        return path
    remove_cgroup(path)
    return None


def release_cgroup(path, seconds=2.0):
    """Remove the attempt's cgroup once it is empty: the wrapper may still be on its way out."""
    deadline = time.time() + seconds
    while os.path.isdir(path) and cgroup_pids(path) and time.time() < deadline:
        time.sleep(0.02)
    remove_cgroup(path)


def remove_cgroup(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def enter_cgroup(path):
    def enter():
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write("0")
    return enter


def record_containment(d, layer, pid, cgroup):
    write_atomic(os.path.join(d, CONTAINMENT_FILE), json.dumps({
        "layer": layer, "cgroup": cgroup, "session": pid, "session_start": start_time(pid)}))


def layers():
    """The containment layers to try, best first; LONGRUN_CONTAINMENT on the host picks one (session is the
    fallback of every layer)."""
    offered = (["systemd-scope"] if systemd_scope("probe") else []) + (["cgroup"] if cgroup_of() else [])
    chosen = os.environ.get(CONTAINMENT_VAR)
    return [layer for layer in offered if chosen in (None, layer)] + ["session"]


def read_containment(d):
    raw = read(os.path.join(d, CONTAINMENT_FILE))
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        found = {}
    return {"layer": found.get("layer", "session"), "cgroup": found.get("cgroup"),
            "session": found.get("session"), "session_start": found.get("session_start")}


def node_members(d, token):
    """Every live process of the attempt's node: its cgroup, its session and the carriers of its token."""
    box = read_containment(d)
    pids = node_carriers(d, token) if token else set()
    if box["cgroup"] and os.path.isdir(box["cgroup"]):
        pids |= cgroup_pids(box["cgroup"])
    if box["session"]:
        pids |= session_members(int(box["session"]), box["session_start"])
    pids.discard(os.getpid())
    return pids


def kill_cgroup(path):
    """SIGKILL every process of the cgroup at once (cgroup.kill, Linux >= 5.14), so none can fork away."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
