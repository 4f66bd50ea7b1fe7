"""The probe and cancel verbs over an attempt directory: a node's state, its new metric lines and log text, and a
stop in the same round trip. The directory says whether Slurm holds the attempt (slurm.py) or a wrapper does."""

import os
import time

from .files import (
    ENDED_FILE,
    ERROR_FILE,
    EXIT_FILE,
    FAILURE_BYTES,
    LOG_FILE,
    LOG_KEPT_BYTES,
    METRICS_FILE,
    READ_LIMIT,
    STARTED_FILE,
    read,
    read_from,
    read_time,
    space_note,
    tail,
)
from .gpus import gpus
from .procfs import carries_token
from .slurm import slurm_job, slurm_status, slurm_stop
from .stop import stop_attempt, sweep


def _status(d):
    code = read(os.path.join(d, EXIT_FILE))
    pid = read(os.path.join(d, "pid"))
    token = read(os.path.join(d, "token"))
    if code is not None:
        return {"state": "exited", "exit_code": int(code), "pid": int(pid) if pid else None}
    if pid is None:
        return {"state": "missing", "exit_code": None, "pid": None}
    pid = int(pid)
    if carries_token(pid, token):
        return {"state": "running", "exit_code": None, "pid": pid}
    # re-read: the wrapper may have written its exit code between the two reads
    code = read(os.path.join(d, EXIT_FILE))
    if code is not None:
        return {"state": "exited", "exit_code": int(code), "pid": pid}
    return {"state": "lost", "exit_code": None, "pid": pid}


def _size(path):
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def probe(req):
    """Status, new metric lines and log text; once the job is over, what is left of the attempt is stopped."""
    d = req["dir"]
    slurm = slurm_job(d) is not None
    out = slurm_status(d) if slurm else _status(d)
    if out["state"] in ("lost", "exited"):
        out.update(sweep(d, None if slurm else out["pid"]))
    # nothing of the job writes on: what its files end with is final (a job queued again by its scheduler, or
    # processes that would not stop, may still write)
    over = out["state"] not in ("running", "pending") and not out.get("remaining")
    limit = max(4096, min(int(req.get("limit", READ_LIMIT)), READ_LIMIT))  # smaller while the store refuses writes
    # a metric line ends at a newline only: a raw \r inside one is part of it; once the job is over, a last line
    # it left without one is handed back too (the worker says so when it is not a metric line)
    metrics, m_off, m_more, m_id, m_change, _ = read_from(
        os.path.join(d, METRICS_FILE), int(req.get("metrics_offset", 0)), limit, line_ends=b"\n", final=over,
        identity=req.get("metrics_identity"))
    # tqdm redraws its bar after a carriage return, without a newline until the bar closes; once the job is over
    # its last, unterminated log line is final: hand it back too. Only the log's last LOG_KEPT_BYTES are kept
    # (worker/ingest.py): once the job is over, what lies before them is skipped, not read, so its outcome never
    # waits on reading a log of any length; the answer says how much (`log_skipped`)
    log, l_off, l_more, l_id, l_change, l_skipped = read_from(
        os.path.join(d, LOG_FILE), int(req.get("log_offset", 0)), limit, final=out["state"] != "running",
        identity=req.get("log_identity"), keep=int(req.get("log_keep", LOG_KEPT_BYTES)) if over else None)
    out.update(metrics=metrics, metrics_offset=m_off, log=log, log_offset=l_off, more=m_more or l_more,
               metrics_identity=m_id, log_identity=l_id, log_skipped=l_skipped,
               log_left=max(0, _size(os.path.join(d, LOG_FILE)) - l_off))
    # a file the job truncated or wrote anew is read again from its start: said, with the offset read to before
    out["reread"] = [{"file": name, "offset": int(req.get(key, 0)), "how": how}
                     for name, key, how in ((METRICS_FILE, "metrics_offset", m_change), (LOG_FILE, "log_offset", l_change))
                     if how is not None]
    if not slurm:
        # the wrapper's record of the job's start and end, and this host's clock now to set them against
        out["times"] = {"started": read_time(d, STARTED_FILE), "ended": read_time(d, ENDED_FILE), "now": time.time()}
    # a Slurm job's GPUs are on its compute nodes, not on the login node that answers
    if req.get("gpus") and not slurm:
        out["gpus"] = gpus({**req["gpus"], "dirs": {read(os.path.join(d, "token")): d}})
    if (out["state"] == "lost" or out["exit_code"] not in (None, 0)) and not out.get("note"):
        out["note"] = space_note(d)
    if out["exit_code"] not in (None, 0) and not out["more"]:
        out["failure"] = {"error_file": tail(os.path.join(d, ERROR_FILE), FAILURE_BYTES),
                          "log_tail": tail(os.path.join(d, LOG_FILE), FAILURE_BYTES)}
    return out


def cancel(req):
    """Stop the attempt (below); in the same call, when asked, a GPU snapshot once nothing of it remains
    (`gpus`: to check that none of its processes still holds GPU memory) and a last `probe` from the given
    offsets (`probe`: what it wrote until the end), so that a cancel is one round trip."""
    d = req["dir"]
    slurm = slurm_job(d) is not None
    out = (slurm_stop if slurm else stop_attempt)(d, float(req.get("grace", 10)))
    if req.get("gpus") and not out["remaining"] and not slurm:
        out["gpus"] = gpus({**req["gpus"], "dirs": {read(os.path.join(d, "token")): d}})
    if req.get("probe") is not None:
        out["probe"] = probe({**req["probe"], "dir": d})
    return out
