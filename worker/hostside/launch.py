"""The launch verb and the wrapper it starts: the job started detached in the best containment the host offers,
watched until it ends and its exit code recorded."""

import json
import os
import signal
import subprocess
import sys
import time

from . import files
from .containment import (
    enter_cgroup,
    layers,
    new_cgroup,
    read_containment,
    record_containment,
    remove_cgroup,
    systemd_scope,
    unit_name,
)
from .files import (
    CONTAINMENT_FILE,
    DIR_VAR,
    ENDED_FILE,
    ERROR_FILE,
    EXIT_RESERVE,
    LOG_FILE,
    METRICS_FILE,
    STARTED_FILE,
    STOP_FILE,
    TOKEN_VAR,
    read,
    write_atomic,
    write_exit_code,
    write_time,
)
from .procfs import cgroup_of
from .slurm import slurm_launch
from .totals import totals


def _interface_with(address):
    """The name of this host's network interface whose IPv4 address `address` is (or resolves to), if any."""
    import fcntl
    import socket
    import struct

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(address, None, socket.AF_INET)}
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) in wanted:
                return name
    return None


def _agent_path():
    """What runs this agent again: the installed agent it was started from (hostside-<sha>, the zipapp
    worker/host_agent.py ships, unpacked; or a zipapp), or, from the source tree, the package directory (python runs
    its __main__.py)."""
    package = os.path.dirname(os.path.abspath(__file__))
    installed = os.path.dirname(package)
    if os.path.isfile(installed) or os.path.isfile(os.path.join(installed, "__main__.py")):
        return installed
    return package


def _start_wrapper(d, env, cwd, layer):
    """Start the detached wrapper in the containment `layer`; returns (the Popen, its cgroup directory or None), or
    None if that layer failed. Popen returns once the wrapper has exec'd, so it is in its session (and cgroup) by
    then. It starts with SIGTERM and SIGHUP ignored: a cancel that comes while its interpreter starts must not stop
    it before it has started the job (it gives the job the default handlers back)."""
    # -S: the wrapper needs only the standard library, and a venv's site hooks would double its start-up; -X utf8:
    # its paths and files are UTF-8 whatever the host's locale (the job's own environment is left as it was)
    argv = [sys.executable, "-S", "-X", "utf8", _agent_path(), "wrap", d, layer]
    unit = unit_name(env[TOKEN_VAR], d)
    cgroup = None
    if layer == "systemd-scope":
        argv = systemd_scope(unit) + argv
    elif layer == "cgroup":
        cgroup = new_cgroup(unit)
        if cgroup is None:
            return None

    def enter():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if cgroup:
            enter_cgroup(cgroup)()

    devnull = open(os.devnull, "r+b")
    try:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=devnull, stdout=devnull, stderr=devnull,
                                start_new_session=True, close_fds=True, preexec_fn=enter), cgroup
    except (OSError, subprocess.SubprocessError):
        if cgroup:
            remove_cgroup(cgroup)
        return None


def launch(req):
    """Start the detached wrapper in the best containment the host offers and return once it holds the
    attempt; a second call for the same dir is a no-op. Refused, with nothing written, when the workspace or the
    attempt directory no longer leads inside the workspace as registered."""
    d = req["dir"]
    moved = files.workspace_moved(req, d)
    if moved is not None:
        return {"error": f"launch: {moved}"}
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    if req.get("slurm"):
        return slurm_launch(req)
    existing = read(os.path.join(d, "pid"))
    if existing:
        return {"pid": int(existing), "already": True}
    write_atomic(os.path.join(d, "token"), req["token"])
    write_atomic(os.path.join(d, "job.json"), json.dumps({**req, "umask": files.CALLER_UMASK}))
    env = dict(os.environ)
    env.update(req.get("env") or {})
    if req.get("node_address") and "GLOO_SOCKET_IFNAME" not in env:
        # gloo binds where the hostname resolves, else to loopback: other nodes may reach neither
        ifname = _interface_with(req["node_address"])
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
    env[TOKEN_VAR] = req["token"]
    env["LONGRUN_METRICS_FILE"] = os.path.join(d, METRICS_FILE)
    env["TORCHELASTIC_ERROR_FILE"] = os.path.join(d, ERROR_FILE)
    env[DIR_VAR] = d
    # the bytes an exit code needs, taken while there is room (see files.write_exit_code)
    write_atomic(os.path.join(d, EXIT_RESERVE), " " * 8)
    for layer in layers():
        started = _start_wrapper(d, env, req.get("cwd") or d, layer)
        if started is None:
            continue
        proc, cgroup = started
        if layer != "systemd-scope":
            # its session and cgroup are known here: record them now rather than wait for its interpreter to start
            record_containment(d, layer, proc.pid, cgroup)
            break
        if _wait_contained(d, proc):  # systemd chooses the scope's cgroup: the wrapper records it
            break
    else:
        return {"error": f"could not start the job's wrapper in {d}"}
    write_atomic(os.path.join(d, "pid"), str(proc.pid))
    answer = {"pid": proc.pid, "already": False, "containment": read_containment(d)["layer"]}
    if req.get("totals"):
        # what a foreign trainer's total steps follow from, read here where its config and data are
        answer["totals"] = totals(req["totals"], default_cwd=req.get("cwd") or d)
    return answer


def _wait_contained(d, proc, seconds=10.0):
    """Wait until the wrapper recorded its containment; False when it exited first (that layer failed)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if read(os.path.join(d, CONTAINMENT_FILE)) is not None:
            return True
        if proc.poll() is not None:
            return read(os.path.join(d, CONTAINMENT_FILE)) is not None
        time.sleep(0.01)
    return True


def _default_signals():
    # ignored signals survive exec: give the job the default handlers back
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def wrap(d, layer):
    """Runs detached: start the job in this session, wait, record its exit code (and, in a systemd scope, first
    the containment: only there is the cgroup not known before it runs)."""
    job = json.loads(read(os.path.join(d, "job.json")))
    if layer == "systemd-scope":
        record_containment(d, layer, os.getpid(), cgroup_of())
    # the group gets SIGTERM on cancel; the wrapper must outlive the job to record its exit (the launch already
    # started it with both ignored; this holds when it is run by hand)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    umask = int(job.get("umask", 0o022))

    def prepare():
        _default_signals()
        os.umask(umask)

    stop = os.path.join(d, STOP_FILE)
    if os.path.exists(stop):  # stopped before the job started: it never does
        write_exit_code(d, 128 + signal.SIGTERM)
        return
    with open(os.path.join(d, LOG_FILE), "ab", buffering=0) as log:
        try:
            child = subprocess.Popen(job["argv"], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=job.get("cwd") or d, preexec_fn=prepare)
        except OSError as exc:
            log.write(f"longrun: could not start {job['argv'][0]!r}: {exc}\n".encode())
            write_exit_code(d, 127)
            return
        write_time(d, STARTED_FILE)
        if os.path.exists(stop):
            # the stop's signals may have come before the job existed; a stop that comes later finds it
            child.send_signal(signal.SIGTERM)
        rc = child.wait()
    write_time(d, ENDED_FILE)  # before the exit code: a probe that sees the job over sees when it ended
    write_exit_code(d, 128 - rc if rc < 0 else rc)
