"""The host-side agent: the only code longrun runs on a host, stdlib only, Python >= 3.8.

Each call is one command, `python3 hostside.py VERB 'JSON'`, answering one JSON line on stdout,
so every action is a single round trip over the transport and needs no state on the host
beyond the files in the attempt directory the worker names (server/layout.py decides where it is):

    <attempt dir>/
        token       the attempt token, also in every process's environment (LONGRUN_ATTEMPT_TOKEN)
        pid         the wrapper's pid (= its process group and session id)
        exit_code   written by the wrapper when the job ends
        output.log  the job's stdout and stderr
        metrics.jsonl

Verbs: launch, wrap (internal: the detached wrapper), probe, cancel, clean, gpus.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

TOKEN_VAR = "LONGRUN_ATTEMPT_TOKEN"
LOG_FILE = "output.log"
METRICS_FILE = "metrics.jsonl"


def _write_atomic(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def launch(req):
    """Start the detached wrapper and return at once; a second call for the same dir is a no-op."""
    d = req["dir"]
    os.makedirs(d, exist_ok=True)
    existing = _read(os.path.join(d, "pid"))
    if existing:
        return {"pid": int(existing), "already": True}
    _write_atomic(os.path.join(d, "token"), req["token"])
    _write_atomic(os.path.join(d, "job.json"), json.dumps(req))
    env = dict(os.environ)
    env.update(req.get("env") or {})
    if req.get("node_address") and "GLOO_SOCKET_IFNAME" not in env:
        # gloo binds where the hostname resolves, else to loopback: other nodes may reach neither
        ifname = _interface_with(req["node_address"])
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname
    env[TOKEN_VAR] = req["token"]
    env["LONGRUN_METRICS_FILE"] = os.path.join(d, METRICS_FILE)
    env["LONGRUN_ATTEMPT_DIR"] = d
    devnull = open(os.devnull, "r+b")
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "wrap", d],
        env=env, cwd=req.get("cwd") or d, stdin=devnull, stdout=devnull, stderr=devnull,
        start_new_session=True, close_fds=True,
    )
    _write_atomic(os.path.join(d, "pid"), str(proc.pid))
    return {"pid": proc.pid, "already": False}


def _default_signals():
    # ignored signals survive exec: give the job the default handlers back
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def wrap(d):
    """Runs detached: start the job in this process group, wait, record its exit code."""
    job = json.loads(_read(os.path.join(d, "job.json")))
    # the group gets SIGTERM on cancel; the wrapper must outlive the job to record its exit
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with open(os.path.join(d, LOG_FILE), "ab", buffering=0) as log:
        try:
            child = subprocess.Popen(job["argv"], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=job.get("cwd") or d,
                                     preexec_fn=_default_signals)
        except OSError as exc:
            log.write(f"longrun: could not start {job['argv'][0]!r}: {exc}\n".encode())
            _write_atomic(os.path.join(d, "exit_code"), "127")
            return
        rc = child.wait()
    _write_atomic(os.path.join(d, "exit_code"), str(128 - rc if rc < 0 else rc))


def _status(d):
    code = _read(os.path.join(d, "exit_code"))
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
    code = _read(os.path.join(d, "exit_code"))
    if code is not None:
        return {"state": "exited", "exit_code": int(code), "pid": pid}
    return {"state": "lost", "exit_code": None, "pid": pid}


def _read_from(path, offset, limit, whole_lines=True):
    """Text from byte offset on, at most `limit` bytes, ending at a line end (\\n or \\r) unless told otherwise.

    Returns (text, new_offset, more): `more` says the limit cut the read short."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return "", offset, False
    more = len(data) == limit
    if whole_lines:
        # tqdm redraws its bar after a carriage return, without a newline until the bar closes
        cut = max(data.rfind(b"\n"), data.rfind(b"\r"))
        # one line longer than the limit goes through in pieces rather than blocking the stream
        data = data[: cut + 1] if cut >= 0 or not more else data
    return data.decode("utf-8", "replace"), offset + len(data), more


def probe(req):
    d = req["dir"]
    out = _status(d)
    limit = int(req.get("limit", 4 << 20))
    metrics, m_off, m_more = _read_from(os.path.join(d, METRICS_FILE), int(req.get("metrics_offset", 0)), limit)
    # once the job is over its last, unterminated log line is final: hand it back too
    log, l_off, l_more = _read_from(os.path.join(d, LOG_FILE), int(req.get("log_offset", 0)), limit,
                                    whole_lines=out["state"] == "running")
    out.update(metrics=metrics, metrics_offset=m_off, log=log, log_offset=l_off, more=m_more or l_more)
    if req.get("gpus"):
        out["gpus"] = gpus(req["gpus"])
    return out


def _signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _signal_group(group, token, sig):
    # the pid file may be stale: only signal the group while its leader still carries our token
    if group and _carries_token(group, token):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_gone(token, seconds):
    deadline = time.time() + seconds
    while pids_with_token(token):
        if time.time() >= deadline:
            return False
        time.sleep(0.05)
    return True


def cancel(req):
    """Stop the attempt (below); in the same call, when asked, a GPU snapshot once nothing of it remains
    (`gpus`: to check that none of its processes still holds GPU memory) and a last `probe` from the given
    offsets (`probe`: what it wrote until the end), so that a cancel is one round trip."""
    d = req["dir"]
    out = _stop(d, float(req.get("grace", 10)))
    if req.get("gpus") and not out["remaining"]:
        out["gpus"] = gpus(req["gpus"])
    if req.get("probe") is not None:
        out["probe"] = probe({**req["probe"], "dir": d})
    return out


def _stop(d, grace):
    """SIGTERM the group and every token carrier, wait `grace`, SIGKILL what is left, verify."""
    token = _read(os.path.join(d, "token"))
    if token is None:
        return {"remaining": [], "signalled": [], "exit_code": None}
    pid = _read(os.path.join(d, "pid"))
    group = int(pid) if pid else None
    signalled = pids_with_token(token)
    _signal_group(group, token, signal.SIGTERM)
    # torchrun workers may run in sessions of their own: reach them by token
    _signal_all(signalled, signal.SIGTERM)
    if not _wait_gone(token, grace):
        _signal_group(group, token, signal.SIGKILL)
        _signal_all(pids_with_token(token), signal.SIGKILL)
        _wait_gone(token, 5)
    if _read(os.path.join(d, "exit_code")) is None:
        _write_atomic(os.path.join(d, "exit_code"), "137")
    return {"remaining": pids_with_token(token), "signalled": signalled,
            "exit_code": int(_read(os.path.join(d, "exit_code")))}


def clean(req):
    """Empty a directory strictly inside the workspace and outside longrun's records (resolved: symlinks
    cannot lead out)."""
    workspace = os.path.realpath(req["workspace"])
    target = req["path"]
    if not os.path.isabs(target):
        return {"error": f"refusing to clean {target!r}: not an absolute path"}
    real = os.path.realpath(target)
    inside = os.path.commonpath([workspace, real]) == workspace and real != workspace
    if not inside:
        return {"error": f"refusing to clean {target}: it resolves to {real}, outside the host workspace {workspace}"}
    records = os.path.realpath(req["records"])
    if real == records or real.startswith(records + os.sep):
        return {"error": f"refusing to clean {target}: it holds longrun's own records"}
    if not os.path.exists(real):
        return {"removed": 0}
    if not os.path.isdir(real):
        return {"error": f"refusing to clean {target}: not a directory"}
    kept = []
    if req.get("keep_into"):
        # a warm restart starts from the last draft: move it aside before the directory is emptied
        keep = os.path.realpath(req["keep_into"])
        if os.path.commonpath([workspace, keep]) != workspace:
            return {"error": f"refusing to keep the draft in {keep}: outside the host workspace {workspace}"}
        os.makedirs(keep, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            if os.path.isfile(os.path.join(real, name)):
                os.replace(os.path.join(real, name), os.path.join(keep, name))
                kept.append(name)
    removed = 0
    for name in os.listdir(real):
        path = os.path.join(real, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        removed += 1
    return {"removed": removed, "kept": kept}


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
    for line in out["apps"]["stdout"].splitlines():
        first = line.split(",")[0].strip()
        if first.isdigit():
            pid = int(first)
            owners[pid] = {"user": _user_of(pid),
                           "token": next((t for t, pids in tokens.items() if pid in pids), None)}
    out["owners"] = owners
    return out


VERBS = {"launch": launch, "probe": probe, "cancel": cancel, "clean": clean, "gpus": gpus}


def main(argv):
    if len(argv) >= 2 and argv[0] == "wrap":
        wrap(argv[1])
        return 0
    if len(argv) != 2 or argv[0] not in VERBS:
        sys.stdout.write(json.dumps({"error": f"usage: hostside.py {'|'.join(VERBS)} JSON"}) + "\n")
        return 2
    result = VERBS[argv[0]](json.loads(argv[1]))
    sys.stdout.write(json.dumps(result) + "\n")
    return 2 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
