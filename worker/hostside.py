"""The host-side agent: the only code longrun runs on a host, stdlib only, Python >= 3.8.

Each call is one command, `python3 hostside.py VERB`, reading its request as one JSON line on stdin
(never argv: env values and the attempt token must not show in `ps`) and answering one JSON line on
stdout, so every action is a single round trip over the transport and needs no state on the host
beyond the files in the attempt directory the worker names (server/layout.py decides where it is):

    <attempt dir>/      0700, its files 0600 (they hold the token and the job's env)
        token       the attempt token, also in every process's environment (LONGRUN_ATTEMPT_TOKEN)
        job.json    the launch request, read by the wrapper
        pid         the wrapper's pid (= its process group and session id)
        containment JSON: the layer that holds every process of the attempt, written by the wrapper
        exit_code   written by the wrapper when the job ends (from exit_code.reserve when the disk is full)
        output.log  the job's stdout and stderr
        metrics.jsonl

Containment, the best layer the host offers (a job cannot leave the first two; `env -i setsid` leaves
the third):
    systemd-scope  a transient scope (`systemd-run --scope`) where systemd runs: its own cgroup
    cgroup         a cgroup v2 directory of its own under ours, where that is writable (root, delegation)
    session        its own session; swept by session id and by the token in the environment
Every layer also sweeps the token carriers. Cancel kills the cgroup (cgroup.kill) and checks it is empty.

Verbs: launch, wrap (internal: the detached wrapper), probe, cancel, clean, gpus, interconnect.

An attempt on a Slurm cluster (a launch that carries `slurm`, see the Slurm section below) is a batch job instead
of a wrapper: its directory holds `slurm_job` (the job id) in place of `pid` and `containment`, Slurm writes
output.log, and probe and cancel ask Slurm about it. The directory tells which, so probe and cancel need nothing
more from the worker.
"""

import errno
import hashlib
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time

TOKEN_VAR = "LONGRUN_ATTEMPT_TOKEN"
CONTAINMENT_VAR = "LONGRUN_CONTAINMENT"
DIR_VAR = "LONGRUN_ATTEMPT_DIR"
LOG_FILE = "output.log"
METRICS_FILE = "metrics.jsonl"
CONTAINMENT_FILE = "containment"
EXIT_FILE = "exit_code"
# torch elastic's error file: torchrun copies there the exception its first failed rank recorded (@record)
ERROR_FILE = "error.json"
# how much of it, and of the log's end (where torchrun names that rank), a probe of a failed job hands back
FAILURE_BYTES = 16 << 10
# written at launch, so that the exit code finds room on a disk the job has filled since
EXIT_RESERVE = "exit_code.reserve"
# written by a stop before it signals: a wrapper still starting then stops the job it starts (or starts none)
STOP_FILE = "stop_requested"
# less free space than this where an attempt ended badly is named as a likely cause
LOW_SPACE = 1 << 20
# how long a probe gives what is left of an attempt whose job is over (or whose wrapper died) before SIGKILL
LOST_GRACE = 5.0
# the umask hostside was started with: the job gets it back (hostside's own files are private)
CALLER_UMASK = 0o022


def _write_atomic(path, text, replace=True):
    """Write `path` whole or not at all; with replace=False a file already there is kept (first writer wins)."""
    tmp = f"{path}.{os.getpid()}.tmp"  # per writer: two processes may write the same file at once
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path, replace)
    finally:
        _remove_quietly(tmp)


def _publish(tmp, path, replace):
    if replace:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass


def _remove_quietly(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _environ(pid):
    """The environment entries of a live process, or None when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def _token_carriers(tokens):
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
    return _token_carriers([token])[token]


def _carries_token(pid, token):
    return bool(pid) and (f"{TOKEN_VAR}={token}").encode() in (_environ(pid) or ())


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


def _cgroup2_mount():
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or /sys/fs/cgroup/unified in hybrid mode)."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields, _, fs = line.partition(" - ")
                if fs.split()[:1] == ["cgroup2"]:
                    return fields.split()[4]
    except OSError:
        pass
    return None


def _cgroup_of(pid="self"):
    """The cgroup v2 directory of a process, or None without a cgroup v2 hierarchy."""
    mount = _cgroup2_mount()
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if mount is None or path is None:
        return None
    return os.path.join(mount, path.lstrip("/")).rstrip("/")


def _unit_name(token, d):
    # cgroup names are world-readable: name the attempt's node by a digest, never by its token
    return "longrun-" + hashlib.sha256(f"{token}\0{d}".encode()).hexdigest()[:16]


def _systemd_scope(unit):
    """The argv prefix that starts the wrapper in a transient systemd scope, or None where systemd does not run
    on a cgroup v2 hierarchy (the scope is then killed and checked through its cgroup directory)."""
    tool = shutil.which("systemd-run")
    if not os.path.isdir("/run/systemd/system") or tool is None or _cgroup2_mount() is None:
        return None
    user = ["--user"] if os.getuid() != 0 else []
    return [tool, *user, "--scope", "--quiet", "--collect", f"--unit={unit}.scope", "--"]


def _new_cgroup(unit):
    """A cgroup v2 directory of the attempt's own, under ours, or None when we may not make one."""
    ours = _cgroup_of()
    if ours is None:
        return None
    path = os.path.join(ours, unit)
    try:
        os.makedirs(path, mode=0o755, exist_ok=True)
    except OSError:
        return None
    if os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        return path
    _remove_cgroup(path)
    return None


def _release_cgroup(path, seconds=2.0):
    """Remove the attempt's cgroup once it is empty: the wrapper may still be on its way out."""
    deadline = time.time() + seconds
    while os.path.isdir(path) and _cgroup_pids(path) and time.time() < deadline:
        time.sleep(0.02)
    _remove_cgroup(path)


def _remove_cgroup(path):
    try:
        os.rmdir(path)
    except OSError:
        pass


def _enter_cgroup(path):
    def enter():
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write("0")
    return enter


def _start_wrapper(d, env, cwd, layer):
    """Start the detached wrapper in the containment `layer`; returns (the Popen, its cgroup directory or None), or
    None if that layer failed. Popen returns once the wrapper has exec'd, so it is in its session (and cgroup) by
    then. It starts with SIGTERM and SIGHUP ignored: a cancel that comes while its interpreter starts must not stop
    it before it has started the job (it gives the job the default handlers back)."""
    # -S: the wrapper needs only the standard library, and a venv's site hooks would double its start-up
    argv = [sys.executable, "-S", os.path.abspath(__file__), "wrap", d, layer]
    unit = _unit_name(env[TOKEN_VAR], d)
    cgroup = None
    if layer == "systemd-scope":
        argv = _systemd_scope(unit) + argv
    elif layer == "cgroup":
        cgroup = _new_cgroup(unit)
        if cgroup is None:
            return None

    def enter():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if cgroup:
            _enter_cgroup(cgroup)()

    devnull = open(os.devnull, "r+b")
    try:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=devnull, stdout=devnull, stderr=devnull,
                                start_new_session=True, close_fds=True, preexec_fn=enter), cgroup
    except (OSError, subprocess.SubprocessError):
        if cgroup:
            _remove_cgroup(cgroup)
        return None


def _record_containment(d, layer, pid, cgroup):
    _write_atomic(os.path.join(d, CONTAINMENT_FILE), json.dumps({
        "layer": layer, "cgroup": cgroup, "session": pid, "session_start": _start_time(pid)}))


def _layers():
    """The containment layers to try, best first; LONGRUN_CONTAINMENT on the host picks one (session is the
    fallback of every layer)."""
    offered = (["systemd-scope"] if _systemd_scope("probe") else []) + (["cgroup"] if _cgroup_of() else [])
    chosen = os.environ.get(CONTAINMENT_VAR)
    return [layer for layer in offered if chosen in (None, layer)] + ["session"]


def launch(req):
    """Start the detached wrapper in the best containment the host offers and return once it holds the
    attempt; a second call for the same dir is a no-op."""
    d = req["dir"]
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    if req.get("slurm"):
        return slurm_launch(req)
    existing = _read(os.path.join(d, "pid"))
    if existing:
        return {"pid": int(existing), "already": True}
    _write_atomic(os.path.join(d, "token"), req["token"])
    _write_atomic(os.path.join(d, "job.json"), json.dumps({**req, "umask": CALLER_UMASK}))
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
    # the bytes an exit code needs, taken while there is room (see _record_exit)
    _write_atomic(os.path.join(d, EXIT_RESERVE), " " * 8)
    for layer in _layers():
        started = _start_wrapper(d, env, req.get("cwd") or d, layer)
        if started is None:
            continue
        proc, cgroup = started
        if layer != "systemd-scope":
            # its session and cgroup are known here: record them now rather than wait for its interpreter to start
            _record_containment(d, layer, proc.pid, cgroup)
            break
        if _wait_contained(d, proc):  # systemd chooses the scope's cgroup: the wrapper records it
            break
    else:
        return {"error": f"could not start the job's wrapper in {d}"}
    _write_atomic(os.path.join(d, "pid"), str(proc.pid))
    return {"pid": proc.pid, "already": False, "containment": _containment(d)["layer"]}


def _wait_contained(d, proc, seconds=10.0):
    """Wait until the wrapper recorded its containment; False when it exited first (that layer failed)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if _read(os.path.join(d, CONTAINMENT_FILE)) is not None:
            return True
        if proc.poll() is not None:
            return _read(os.path.join(d, CONTAINMENT_FILE)) is not None
        time.sleep(0.01)
    return True


def _default_signals():
    # ignored signals survive exec: give the job the default handlers back
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _start_time(pid):
    """The process's start time in clock ticks since boot: with the pid, it names one process for ever."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def wrap(d, layer):
    """Runs detached: start the job in this session, wait, record its exit code (and, in a systemd scope, first
    the containment: only there is the cgroup not known before it runs)."""
    job = json.loads(_read(os.path.join(d, "job.json")))
    if layer == "systemd-scope":
        _record_containment(d, layer, os.getpid(), _cgroup_of())
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
        _record_exit(d, 128 + signal.SIGTERM)
        return
    with open(os.path.join(d, LOG_FILE), "ab", buffering=0) as log:
        try:
            child = subprocess.Popen(job["argv"], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=job.get("cwd") or d, preexec_fn=prepare)
        except OSError as exc:
            log.write(f"longrun: could not start {job['argv'][0]!r}: {exc}\n".encode())
            _record_exit(d, 127)
            return
        if os.path.exists(stop):
            # the stop's signals may have come before the job existed; a stop that comes later finds it
            child.send_signal(signal.SIGTERM)
        rc = child.wait()
    _record_exit(d, 128 - rc if rc < 0 else rc)


def _record_exit(d, code):
    """The attempt's exit code, first writer wins: the wrapper when its job ends, or a stop that cut the
    launcher's teardown short (which the wrapper then sees as a SIGKILL that must not replace it)."""
    path = os.path.join(d, EXIT_FILE)
    try:
        _write_atomic(path, str(code), replace=False)
    except OSError:
        # no room for a new file: the reserve's bytes are already allocated
        reserve = os.path.join(d, EXIT_RESERVE)
        with open(reserve, "r+") as f:
            f.write(str(code).ljust(8))
        _publish(reserve, path, replace=False)
        _remove_quietly(reserve)


def _containment(d):
    raw = _read(os.path.join(d, CONTAINMENT_FILE))
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        found = {}
    return {"layer": found.get("layer", "session"), "cgroup": found.get("cgroup"),
            "session": found.get("session"), "session_start": found.get("session_start")}


def _cgroup_pids(path):
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


def _session_members(sid, started):
    """The live processes of session `sid`, unless that pid now leads another session (pid reuse)."""
    leader_start = _start_time(sid)
    if leader_start is not None and leader_start != started:
        return set()
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            # a zombie holds nothing and cannot be killed; where no init reaps orphans it stays listed
            if len(fields) > 3 and fields[0] != "Z" and fields[3] == str(sid):
                members.add(int(entry))
    return members


def _node_carriers(d, token):
    """The live processes whose environment carries the attempt's token and this node's directory: the nodes
    of one attempt share the token, and two of them may share a host."""
    wanted = {f"{TOKEN_VAR}={token}".encode(), f"{DIR_VAR}={d}".encode()}
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and wanted <= set(_environ(e) or ())}


def _members(d, token):
    """Every live process of the attempt's node: its cgroup, its session and the carriers of its token."""
    box = _containment(d)
    pids = _node_carriers(d, token) if token else set()
    if box["cgroup"] and os.path.isdir(box["cgroup"]):
        pids |= _cgroup_pids(box["cgroup"])
    if box["session"]:
        pids |= _session_members(int(box["session"]), box["session_start"])
    pids.discard(os.getpid())
    return pids


def _status(d):
    code = _read(os.path.join(d, EXIT_FILE))
    pid = _read(os.path.join(d, "pid"))
    token = _read(os.path.join(d, "token"))
    if code is not None:
        return {"state": "exited", "exit_code": int(code), "pid": int(pid) if pid else None}
    if pid is None:
        return {"state": "missing", "exit_code": None, "pid": None}
    pid = int(pid)
    if _carries_token(pid, token):
        return {"state": "running", "exit_code": None, "pid": pid}
    # re-read: the wrapper may have written its exit code between the two reads
    code = _read(os.path.join(d, EXIT_FILE))
    if code is not None:
        return {"state": "exited", "exit_code": int(code), "pid": pid}
    return {"state": "lost", "exit_code": None, "pid": pid}


def _read_from(path, offset, limit, line_ends=b"\n\r", final=False):
    """Text from byte offset on, at most `limit` bytes, ending just after one of `line_ends`; with `final` (the
    file is complete) the last read also hands back an unterminated last line.

    A read cut short by the limit ends at a line end too, so no line is split between two reads; only a line
    longer than the limit goes through in pieces (cut at a character boundary) rather than block the stream.
    Returns (text, new_offset, more): `more` says the limit cut the read short."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return "", offset, False
    more = len(data) == limit
    if more or not final:
        cut = max(data.rfind(bytes([end])) for end in line_ends)
        if cut >= 0:
            data = data[: cut + 1]
        elif more:
            data = _whole_characters(data)
        else:
            data = b""
    return data.decode("utf-8", "replace"), offset + len(data), more


def _whole_characters(data):
    """`data` less a UTF-8 sequence that its end cuts in two."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # the lead byte: its sequence is whole when it is `back` bytes long
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if length <= back else data[:-back]
    return data


def probe(req):
    """Status, new metric lines and log text; once the job is over, what is left of the attempt is stopped."""
    d = req["dir"]
    slurm = _slurm_job(d) is not None
    out = _slurm_status(d) if slurm else _status(d)
    if out["state"] in ("lost", "exited"):
        out.update(_sweep(d, None if slurm else out["pid"]))
    limit = int(req.get("limit", 4 << 20))
    # a metric line ends at a newline only: a raw \r inside one is part of it
    metrics, m_off, m_more = _read_from(os.path.join(d, METRICS_FILE), int(req.get("metrics_offset", 0)), limit,
                                        line_ends=b"\n")
    # tqdm redraws its bar after a carriage return, without a newline until the bar closes; once the job is over
    # its last, unterminated log line is final: hand it back too
    log, l_off, l_more = _read_from(os.path.join(d, LOG_FILE), int(req.get("log_offset", 0)), limit,
                                    final=out["state"] != "running")
    out.update(metrics=metrics, metrics_offset=m_off, log=log, log_offset=l_off, more=m_more or l_more)
    # a Slurm job's GPUs are on its compute nodes, not on the login node that answers
    if req.get("gpus") and not slurm:
        out["gpus"] = gpus({**req["gpus"], "dirs": {_read(os.path.join(d, "token")): d}})
    if (out["state"] == "lost" or out["exit_code"] not in (None, 0)) and not out.get("note"):
        out["note"] = _space_note(d)
    if out["exit_code"] not in (None, 0) and not out["more"]:
        out["failure"] = {"error_file": _tail(os.path.join(d, ERROR_FILE), FAILURE_BYTES),
                          "log_tail": _tail(os.path.join(d, LOG_FILE), FAILURE_BYTES)}
    return out


def _tail(path, limit):
    """The last `limit` bytes of a file as text, or None when it is not there."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _sweep(d, wrapper):
    """Nothing of an attempt runs on once its job is over: a wrapper found dead without an exit code (killed, or
    the OOM killer) left the whole job unwatched, and a job that ended may have left a helper running. Both are
    stopped before the node is answered; `remaining` names what would not stop."""
    token = _read(os.path.join(d, "token"))
    if not (_members(d, token) - {wrapper}):
        cgroup = _containment(d)["cgroup"]
        if cgroup:
            _release_cgroup(cgroup)
        return {"stopped": [], "remaining": []}
    stopped = _stop(d, LOST_GRACE, record_exit=False)
    return {"stopped": stopped["signalled"], "remaining": stopped["remaining"]}


def _space_note(d):
    """Says that the attempt's file system is full, which a job's log cannot say once it is."""
    try:
        fs = os.statvfs(d)
    except OSError:
        return None
    free = fs.f_bavail * fs.f_frsize
    return f"the file system of {d} is full ({free} bytes free)" if free < LOW_SPACE else None


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
        members = _members(d, token)
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
        with open(f"/proc/{launcher}/stat") as f:
            parent = int(f.read().rpartition(")")[2].split()[1])
        with open(f"/proc/{launcher}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return
    if parent == wrapper and b"torch.distributed.run" in argv:
        _record_exit(d, 128 + signal.SIGTERM)
        _signal_all([launcher], signal.SIGKILL)


def _kill_cgroup(path):
    """SIGKILL every process of the cgroup at once (cgroup.kill, Linux >= 5.14), so none can fork away."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass


def cancel(req):
    """Stop the attempt (below); in the same call, when asked, a GPU snapshot once nothing of it remains
    (`gpus`: to check that none of its processes still holds GPU memory) and a last `probe` from the given
    offsets (`probe`: what it wrote until the end), so that a cancel is one round trip."""
    d = req["dir"]
    slurm = _slurm_job(d) is not None
    out = (_slurm_stop if slurm else _stop)(d, float(req.get("grace", 10)))
    if req.get("gpus") and not out["remaining"] and not slurm:
        out["gpus"] = gpus({**req["gpus"], "dirs": {_read(os.path.join(d, "token")): d}})
    if req.get("probe") is not None:
        out["probe"] = probe({**req["probe"], "dir": d})
    return out


def _stop(d, grace, record_exit=True):
    """SIGTERM every process of the attempt (cgroup, session, token carriers), wait `grace`, kill what is left
    (the whole cgroup at once), and verify that nothing remains."""
    token = _read(os.path.join(d, "token"))
    if token is None:
        return {"remaining": [], "signalled": [], "exit_code": None}
    try:
        with open(os.path.join(d, STOP_FILE), "a"):
            pass
    except OSError:  # a full disk must not stop a stop; only a wrapper still starting would miss it
        pass
    cgroup = _containment(d)["cgroup"]
    signalled = sorted(_members(d, token))
    _signal_all(signalled, signal.SIGTERM)
    wrapper = _read(os.path.join(d, "pid"))
    if not _wait_gone(d, token, grace, int(wrapper) if wrapper else None):
        if cgroup:
            _kill_cgroup(cgroup)
        _signal_all(_members(d, token), signal.SIGKILL)
        _wait_gone(d, token, 5)
    remaining = sorted(_members(d, token))
    if cgroup and not remaining:
        _remove_cgroup(cgroup)
    if record_exit:
        _record_exit(d, 137)  # kept only when the wrapper died without recording one
    code = _read(os.path.join(d, EXIT_FILE))
    return {"remaining": remaining, "signalled": signalled, "exit_code": int(code) if code else None}


def _within(workspace, path):
    """The components of `path` below `workspace` (both as given, and the workspace also resolved), or None."""
    target = os.path.normpath(path)
    for base in (os.path.normpath(workspace), os.path.realpath(workspace)):
        rel = os.path.relpath(target, base)
        if rel != "." and rel != ".." and not rel.startswith(".." + os.sep):
            return rel.split(os.sep)
    return None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_below(root_fd, parts, create=False):
    """A directory fd reached from `root_fd` one component at a time, never through a symlink (O_NOFOLLOW):
    a component swapped for a symlink after the check fails with ELOOP/ENOTDIR instead of being followed."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_at(dir_fd, name):
    """Remove `name` in the directory `dir_fd`, a subtree walked by fds (never following a symlink)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=dir_fd)
        return
    try:
        for entry in os.listdir(fd):
            _remove_at(fd, entry)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def clean(req):
    """Empty a directory strictly inside the workspace and outside longrun's records. Every step goes through a
    directory fd opened with O_NOFOLLOW, so no symlink, there from the start or swapped in meanwhile, leads out."""
    workspace = os.path.realpath(req["workspace"])
    target = req["path"]
    if workspace == "/":
        return {"error": f"refusing to clean inside the workspace {req['workspace']!r}: it is the root directory"}
    if not os.path.isabs(target):
        return {"error": f"refusing to clean {target!r}: not an absolute path"}
    parts = _within(req["workspace"], target)
    if parts is None:
        return {"error": f"refusing to clean {target}: not strictly inside the host workspace {workspace}"}
    records = _within(req["workspace"], req["records"])
    if records and parts[:len(records)] == records:
        return {"error": f"refusing to clean {target}: it holds longrun's own records"}
    keep_parts = _within(req["workspace"], req["keep_into"]) if req.get("keep_into") else None
    if req.get("keep_into") and keep_parts is None:
        return {"error": f"refusing to keep the draft in {req['keep_into']}: outside the host workspace {workspace}"}
    root = os.open(workspace, _DIR_FLAGS)
    try:
        try:
            fd = _open_below(root, parts)
        except FileNotFoundError:
            return {"removed": 0}
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return {"error": f"refusing to clean {target}: on the way there is a symlink or a file, which could "
                                 f"lead outside the host workspace {workspace}; it is never followed"}
            return {"error": f"refusing to clean {target}: {os.strerror(exc.errno)}"}
        try:
            kept = _keep_draft(root, fd, keep_parts) if keep_parts else []
            names = os.listdir(fd)
            for name in names:
                _remove_at(fd, name)
        finally:
            os.close(fd)
    finally:
        os.close(root)
    return {"removed": len(names), "kept": kept}


def _keep_draft(root, fd, keep_parts):
    # a warm restart starts from the last draft: move it aside before the directory is emptied
    keep = _open_below(root, keep_parts, create=True)
    kept = []
    try:
        for name in ("model.safetensors", "config.json"):
            try:
                if stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.replace(name, name, src_dir_fd=fd, dst_dir_fd=keep)
                    kept.append(name)
            except FileNotFoundError:
                pass
    finally:
        os.close(keep)
    return kept


def _user_of(pid):
    try:
        import pwd

        uid = os.stat(f"/proc/{pid}").st_uid
        return pwd.getpwuid(uid).pw_name
    except (OSError, KeyError, ImportError):
        return None


def gpus(req):
    """Raw nvidia-smi answers (parsed by the worker), plus who owns each GPU process."""
    out = {}
    for key, cmd in (("gpu", req["query_gpu"]), ("apps", req["query_apps"])):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            out[key] = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
        except FileNotFoundError as exc:
            out[key] = {"rc": 127, "stdout": "", "stderr": str(exc)}
        except subprocess.TimeoutExpired:
            out[key] = {"rc": 124, "stdout": "", "stderr": "nvidia-smi timed out"}
    owners = {}
    tokens = {t: set(pids) for t, pids in _token_carriers(req.get("tokens", [])).items()}
    # any process of an attempt's containment is the attempt's, with or without the token in its environment
    for token, d in (req.get("dirs") or {}).items():
        if token in tokens:
            tokens[token] |= _members(d, token)
    for line in out["apps"]["stdout"].splitlines():
        first = line.split(",")[0].strip()
        if first.isdigit():
            pid = int(first)
            owners[pid] = {"user": _user_of(pid),
                           "token": next((t for t, pids in tokens.items() if pid in pids), None)}
    out["owners"] = owners
    return out


# a command replacing the bundled all-reduce sweep on this host (same arguments, same JSON line)
SWEEP_VAR = "LONGRUN_ALLREDUCE_SWEEP"
# the most of a probe command's output handed back: the worker parses it as untrusted input anyway
PROBE_OUTPUT_LIMIT = 256 << 10


def _captured(argv, timeout):
    """A command's exit status and (bounded) output; 127 when it cannot start, 124 when it ran out of time."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except OSError as exc:
        return {"rc": 127, "stdout": "", "stderr": str(exc)}
    except subprocess.TimeoutExpired:
        return {"rc": 124, "stdout": "", "stderr": f"{argv[0]} did not finish within {timeout:g}s"}
    return {"rc": p.returncode, "stdout": p.stdout[-PROBE_OUTPUT_LIMIT:], "stderr": p.stderr[-PROBE_OUTPUT_LIMIT:]}


def _install_sweep(path, source):
    """Write the sweep script where the worker named it (content-addressed), once."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_atomic(path, source)


def interconnect(req):
    """`nvidia-smi topo -m` and the NCCL all-reduce sweep at tp ranks, both raw (the worker parses them)."""
    topo = _captured(req["topo_cmd"], 30)
    override = os.environ.get(SWEEP_VAR)
    if override:
        argv = shlex.split(override)
    else:
        _install_sweep(req["sweep_path"], req["sweep_source"])
        argv = [sys.executable, req["sweep_path"]]
    argv += ["--tp", "all" if req["tp"] == "all" else str(int(req["tp"]))]
    if req.get("sizes"):
        argv += ["--sizes", ",".join(str(int(n)) for n in req["sizes"])]
    return {"topo": topo, "sweep": _captured(argv, float(req.get("timeout", 600)))}



# --- Slurm: an attempt as a batch job. The login node answers; the attempt directory is on a file system the
# compute nodes share; Slurm holds the processes (its proctrack plugin) and says how the job ended. ---

SLURM_JOB_FILE = "slurm_job"
BATCH_FILE = "batch.sh"
# job states (scontrol/sacct) in which the job waits to start, and those in which it has ended for good;
# any other (RUNNING, COMPLETING, SUSPENDED, ...) may still have processes
SLURM_WAITING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
                 "SPECIAL_EXIT"}
SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
               "OUT_OF_MEMORY", "REVOKED"}
# how long a cancel waits, beyond its grace, for Slurm to end the job after `scancel` (the cluster's KillWait is the
# grace Slurm gives between SIGTERM and SIGKILL)
SLURM_END_WAIT = 60.0


def _slurm(argv, env=None, cwd=None):
    """Run a Slurm command; (exit status, stdout, stderr), 127 when the command is not installed."""
    try:
        p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                           preexec_fn=lambda: os.umask(CALLER_UMASK))
    except FileNotFoundError as exc:
        return 127, "", str(exc)
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not answer within 60s"
    return p.returncode, p.stdout, p.stderr


def _slurm_job(d):
    return _read(os.path.join(d, SLURM_JOB_FILE))


def _slurm_time(text):
    """A time as Slurm prints it (local time of the cluster, 2026-12-01T02:40:43) in seconds since the epoch."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (TypeError, ValueError, OverflowError):
        return None


def _slurm_query(job):
    """What Slurm says of a job: its controller while it remembers the job (MinJobAge after the end), then its
    accounting (sacct, where slurmdbd runs). None when neither knows it."""
    rc, out, _ = _slurm(["scontrol", "show", "job", "--oneliner", job])
    if rc == 0 and out.strip():
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return {"state": fields.get("JobState", ""), "reason": fields.get("Reason"),
                "start": fields.get("StartTime"), "exit": fields.get("ExitCode", "")}
    rc, out, _ = _slurm(["sacct", "--noheader", "--allocations", "--parsable2", "--jobs", job,
                         "--format=State,ExitCode,Start"])
    line = out.strip().splitlines()[:1]
    if rc == 0 and line and line[0].count("|") == 2:
        state, code, start = line[0].split("|")
        # sacct says "CANCELLED by 1000"
        return {"state": state.split()[0] if state else "", "reason": None, "start": start, "exit": code}
    return None


def _slurm_exit_code(text):
    """Slurm's ExitCode `status:signal` as a shell would say it: 128 + the signal when one ended the job."""
    status, _, sig = text.partition(":")
    try:
        return 128 + int(sig) if sig and int(sig) else int(status)
    except ValueError:
        return None


def _slurm_status(d):
    """The node's state from Slurm, and `queue`: the job's id, Slurm state, the reason it waits, and while it waits
    the start Slurm expects (as `squeue --start` shows it)."""
    job = _slurm_job(d)
    found = _slurm_query(job)
    if found is None:
        return {"state": "lost", "exit_code": None, "pid": int(job),
                "note": f"Slurm no longer knows job {job} and has no accounting (sacct) of it"}
    state = found["state"]
    reason = found["reason"] if found["reason"] not in (None, "None", "(null)") else None
    queue = {"job_id": job, "state": state, "reason": reason,
             "expected_start": _slurm_time(found["start"]) if state in SLURM_WAITING else None}
    out = {"state": "running", "exit_code": None, "pid": int(job), "queue": queue}
    if state in SLURM_WAITING:
        out["state"] = "pending"
    elif state in SLURM_ENDED:
        out.update(state="exited", exit_code=_slurm_exit_code(found["exit"]))
        if state != "COMPLETED":
            out["note"] = f"Slurm ended job {job}: {state}" + (f" ({reason})" if reason else "")
    return out


def _slurm_named(name):
    """The id of a job of ours with this name that Slurm still holds: a submit whose answer was lost."""
    rc, out, _ = _slurm(["squeue", "--noheader", "--states=all", f"--name={name}", "--format=%i"])
    ids = out.split() if rc == 0 else []
    return ids[0] if ids else None


def slurm_launch(req):
    """Submit the attempt's batch script (`sbatch`) with the attempt token in the job's environment; a second
    call for the same dir, or after a submit whose answer was lost, returns the first job."""
    d, batch = req["dir"], req["slurm"]
    job = _slurm_job(d)
    already = job is not None
    if not already:
        _write_atomic(os.path.join(d, "token"), req["token"])
        _write_atomic(os.path.join(d, BATCH_FILE), batch["script"])
        job = _slurm_named(batch["job_name"])
        already = job is not None
    if not already:
        env = dict(os.environ)
        env.update(req.get("env") or {})
        env.update({TOKEN_VAR: req["token"], "LONGRUN_METRICS_FILE": os.path.join(d, METRICS_FILE), DIR_VAR: d,
                    "TORCHELASTIC_ERROR_FILE": os.path.join(d, ERROR_FILE)})
        # % starts a Slurm file-name pattern (%j): a literal one is %%
        log = os.path.join(d, LOG_FILE).replace("%", "%%")
        rc, out, err = _slurm(["sbatch", "--parsable", "--export=ALL", f"--job-name={batch['job_name']}",
                               f"--output={log}", "--open-mode=append", f"--chdir={req.get('cwd') or d}",
                               os.path.join(d, BATCH_FILE)], env=env)
        if rc != 0:
            return {"error": f"sbatch refused the job (exit {rc}): {(err or out).strip()[-2000:]}"}
        job = out.strip().split(";")[0]
    _write_atomic(os.path.join(d, SLURM_JOB_FILE), job)
    status = _slurm_status(d)
    return {"pid": int(job), "already": already, "containment": "slurm", "state": status["state"],
            "queue": status.get("queue")}


def _slurm_wait_ended(job, seconds):
    """Wait until Slurm says the job has ended (not COMPLETING); its last state, None when Slurm forgot it."""
    deadline = time.time() + seconds
    while True:
        found = _slurm_query(job)
        if found is None or found["state"] in SLURM_ENDED or time.time() >= deadline:
            return found
        time.sleep(0.2)


def _slurm_stop(d, grace):
    """`scancel` (Slurm sends every process of the job SIGTERM, then SIGKILL after the cluster's KillWait, and
    records it CANCELLED), wait up to `grace` + SLURM_END_WAIT for Slurm to say it has ended (no longer COMPLETING:
    its processes are reaped), then stop any process here that still carries the token. `remaining` names what is
    left: pids here, and the job id while Slurm has not ended it."""
    job = _slurm_job(d)
    found = _slurm_query(job)
    signalled = []
    if found is not None and found["state"] not in SLURM_ENDED:
        _slurm(["scancel", job])
        signalled = [int(job)]
        found = _slurm_wait_ended(job, grace + SLURM_END_WAIT)
    left = _stop(d, LOST_GRACE, record_exit=False)
    remaining = left["remaining"] + ([int(job)] if found is not None and found["state"] not in SLURM_ENDED else [])
    code = _slurm_exit_code(found["exit"]) if found is not None and found["state"] in SLURM_ENDED else None
    return {"remaining": remaining, "signalled": signalled + left["signalled"], "exit_code": code}


VERBS = {"launch": launch, "probe": probe, "cancel": cancel, "clean": clean, "gpus": gpus,
         "interconnect": interconnect}


def main(argv):
    global CALLER_UMASK
    # the attempt's files hold its token and env: private to this user
    CALLER_UMASK = os.umask(0o077)
    if len(argv) == 3 and argv[0] == "wrap":
        wrap(argv[1], argv[2])
        return 0
    if len(argv) != 1 or argv[0] not in VERBS:
        sys.stdout.write(json.dumps({"error": f"usage: hostside.py {'|'.join(VERBS)} < JSON"}) + "\n")
        return 2
    try:
        request = json.loads(sys.stdin.readline())
    except ValueError as exc:
        request = exc
    if not isinstance(request, dict):
        sys.stdout.write(json.dumps({"error": f"{argv[0]}: the request on stdin is not a JSON object"}) + "\n")
        return 2
    result = VERBS[argv[0]](request)
    sys.stdout.write(json.dumps(result) + "\n")
    return 2 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
