"""Slurm: an attempt as a batch job. The login node answers; the attempt directory is on a file system the compute
nodes share; Slurm holds the processes (its proctrack plugin) and says how the job ended. The agent runs sbatch,
scontrol, sacct, squeue and scancel itself; the launch request carries only the batch script and the job's name."""

import os
import subprocess
import time

from . import files
from .files import (
    DIR_VAR,
    ERROR_FILE,
    LOG_FILE,
    METRICS_FILE,
    TOKEN_VAR,
    read,
    write_atomic,
)
from .stop import LOST_GRACE, stop_attempt

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
        p = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, errors="replace", timeout=60, stdin=subprocess.DEVNULL,
                           preexec_fn=lambda: os.umask(files.CALLER_UMASK))
    except FileNotFoundError as exc:
        return 127, "", str(exc)
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not answer within 60s"
    return p.returncode, p.stdout, p.stderr


def slurm_job(d):
    return read(os.path.join(d, SLURM_JOB_FILE))


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
                "start": fields.get("StartTime"), "end": fields.get("EndTime"), "exit": fields.get("ExitCode", "")}
    rc, out, _ = _slurm(["sacct", "--noheader", "--allocations", "--parsable2", "--jobs", job,
                         "--format=State,ExitCode,Start,End"])
    line = out.strip().splitlines()[:1]
    if rc == 0 and line and line[0].count("|") == 3:
        state, code, start, end = line[0].split("|")
        # sacct says "CANCELLED by 1000"
        return {"state": state.split()[0] if state else "", "reason": None, "start": start, "end": end, "exit": code}
    return None


def _slurm_exit_code(text):
    """Slurm's ExitCode `status:signal` as a shell would say it: 128 + the signal when one ended the job."""
    status, _, sig = text.partition(":")
    try:
        return 128 + int(sig) if sig and int(sig) else int(status)
    except ValueError:
        return None


def slurm_status(d):
    """The node's state from Slurm, and `queue`: the job's id, Slurm state, the reason it waits, and while it waits
    the start Slurm expects (as `squeue --start` shows it)."""
    job = slurm_job(d)
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
    if state not in SLURM_WAITING:
        # when Slurm started the job and (once over) ended it, by the cluster's clock, as the wrapper records it
        out["times"] = {"started": _slurm_time(found["start"]),
                        "ended": _slurm_time(found["end"]) if state in SLURM_ENDED else None, "now": time.time()}
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
    job = slurm_job(d)
    already = job is not None
    if not already:
        write_atomic(os.path.join(d, "token"), req["token"])
        write_atomic(os.path.join(d, BATCH_FILE), batch["script"])
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
    write_atomic(os.path.join(d, SLURM_JOB_FILE), job)
    status = slurm_status(d)
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


def slurm_stop(d, grace):
    """`scancel` (Slurm sends every process of the job SIGTERM, then SIGKILL after the cluster's KillWait, and
    records it CANCELLED), wait up to `grace` + SLURM_END_WAIT for Slurm to say it has ended (no longer COMPLETING:
    its processes are reaped), then stop any process here that still carries the token. `remaining` names what is
    left: pids here, and the job id while Slurm has not ended it."""
    job = slurm_job(d)
    found = _slurm_query(job)
    signalled = []
    if found is not None and found["state"] not in SLURM_ENDED:
        _slurm(["scancel", job])
        signalled = [int(job)]
        found = _slurm_wait_ended(job, grace + SLURM_END_WAIT)
    left = stop_attempt(d, LOST_GRACE, record_exit=False)
    remaining = left["remaining"] + ([int(job)] if found is not None and found["state"] not in SLURM_ENDED else [])
    code = _slurm_exit_code(found["exit"]) if found is not None and found["state"] in SLURM_ENDED else None
    return {"remaining": remaining, "signalled": signalled + left["signalled"], "exit_code": code}
