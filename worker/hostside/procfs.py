"""What /proc says: processes' environments (the token carriers), start times, sessions, owners and cgroups."""

import os

from .files import DIR_VAR, TOKEN_VAR


def _environ(pid):
    """The environment entries of a live process, or None when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def token_carriers(tokens):
    """For each attempt token, the live processes whose environment carries it (never match by name)."""
    needles = {(f"{TOKEN_VAR}={t}").encode(): t for t in tokens}
    found = {t: [] for t in tokens}
    for entry in os.listdir("/proc"):
        env = _environ(entry) if entry.isdigit() else None
        for item in env or ():
            if item in needles:
                found[needles[item]].append(int(entry))
    return {t: sorted(pids) for t, pids in found.items()}


def pids_with_token(token):
    return token_carriers([token])[token]


def carries_token(pid, token):
    return bool(pid) and (f"{TOKEN_VAR}={token}").encode() in (_environ(pid) or ())


def cgroup2_mount():
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified in hybrid mode)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields, _, fs = line.partition(" - ")
                if fs.split()[:1] == ["cgroup2"]:
                    return fields.split()[4]
    except OSError:
        pass
    return None


def cgroup_of(pid="self"):
    """The cgroup v2 directory of a process, or None without a cgroup v2 hierarchy."""
    mount = cgroup2_mount()
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="surrogateescape") as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if mount is None or path is None:
        return None
    return os.path.join(mount, path.lstrip("/")).rstrip("/")


def stat_fields(pid):
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...), or None when the
    process is gone. Read as bytes: the name in parentheses is whatever the process set (prctl), in any bytes."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].decode("ascii", "replace").split()
    except OSError:
        return None


def start_time(pid):
    """The process's start time in clock ticks since boot: with the pid, it names one process for ever."""
    try:
        return int(stat_fields(pid)[19])
    except (TypeError, ValueError, IndexError):
        return None


def cgroup_pids(path):
    """Every process in the cgroup and its descendants."""
    pids = set()
    for root, _, files in os.walk(path):
        if "cgroup.procs" in files:
            try:
                with open(os.path.join(root, "cgroup.procs")) as f:
                    pids.update(int(line) for line in f if line.strip())
            except (OSError, ValueError):
                pass
    return pids


def session_members(sid, started):
    """The live processes of session `sid`, unless that pid now leads another session (pid reuse)."""
    leader_start = start_time(sid)
    if leader_start is not None and leader_start != started:
        return set()
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(entry)
            if fields is None:
                continue
            # a zombie holds nothing and cannot be killed; where no init reaps orphans it stays listed
            if len(fields) > 3 and fields[0] != "Z" and fields[3] == str(sid):
                members.add(int(entry))
    return members


def node_carriers(d, token):
    """The live processes whose environment carries the attempt's token and this node's directory: the nodes
    of one attempt share the token, and two of them may share a host."""
    wanted = {f"{TOKEN_VAR}={token}".encode(), f"{DIR_VAR}={d}".encode()}
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and wanted <= set(_environ(e) or ())}


def user_of(pid):
    try:
        import pwd

        uid = os.stat(f"/proc/{pid}").st_uid
        return pwd.getpwuid(uid).pw_name
    except (OSError, KeyError, ImportError):
        return None
