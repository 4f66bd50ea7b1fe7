"""Orchestration latency, longrun against Ray Jobs, side by side on this machine (issue 18).

    python benchmarks/bench_vs_ray.py [--repeat 5] [--pollers 100] [--poll-seconds 15]

Ray goes into a venv of its own (`--ray-venv`, default /tmp/rayvenv: made with `python3 -m venv` and
`pip install 'ray[default]'` when it has no `ray`), outside the repository. The script starts a local Ray
cluster (`ray start --head --block`, its dashboard serving the Jobs REST API) and a real `longrun serve` (API and
embedded worker, the default 1 s tick, the `local` host), and talks to both over HTTP from one client.

Both run the same command: torchrun (this venv's torch) with
- a sleep job that exits on SIGTERM (1 process), and
- a job whose 2 workers ignore SIGTERM (`--stubborn`-style: stopping it takes the grace period, then SIGKILL;
  longrun's LONGRUN_CANCEL_GRACE is set to Ray's stop wait, RAY_JOB_STOP_WAIT_TIME_S, 3 s by default).

Measured `--repeat` times, longrun and Ray alternating, each job marked by an environment variable so that its
processes are found in /proc whoever started them:
- submit → running: longrun `running`; Ray `RUNNING`;
- restart → attempt 2 running: longrun POST /restart until attempt 2 is `running`; Ray stop, wait for STOPPED,
  submit again, until the new job is RUNNING (what a Ray user scripts);
- cancel → verified gone: until the system says so (longrun `cancelled`, Ray `STOPPED`) *and* no process of the
  job is left; processes still alive 15 s after the terminal state are reported as left running (and killed);
- status poll: `--pollers` concurrent clients, each GET once a second (`longrun watch` does), for `--poll-seconds`,
  against GET /v1/runs/{id} and Ray's GET /api/jobs/{id}, while a sleep job runs.

Prints one JSON line per measurement, then a Markdown table (median, min–max), the machine and its load.
"""

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads must not starve the other processes

from benchmarks.bench_service import poll_latencies  # noqa: E402
from benchmarks.bench_ssh import wait_for  # noqa: E402
from tests.service import Service, free_port, processes_with_env  # noqa: E402

MARK = "BENCH_JOB"
# the grace both systems give a job between SIGTERM and SIGKILL (Ray's RAY_JOB_STOP_WAIT_TIME_S default)
GRACE = 3
LEFT_RUNNING_AFTER = 15.0

SLEEP_JOB = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
while True:
    time.sleep(1)
"""

STUBBORN_JOB = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\\n")
while True:
    time.sleep(1)
"""


def started_count(marks: Path) -> int:
    try:
        return len(marks.read_text().splitlines())
    except FileNotFoundError:
        return 0


def job_processes(label: str) -> list[int]:
    return processes_with_env(f"{MARK}={label}")


def kill_marked(needle: str, prefix: bool = False) -> None:
    for pid in processes_with_env(needle, prefix=prefix):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def until_gone(label: str, started: float) -> tuple[float, bool]:
    """Seconds from `started` until no process of the job is left, and whether some were still left after
    LEFT_RUNNING_AFTER (they are then killed)."""
    try:
        wait_for(f"processes of {label} gone", lambda: not job_processes(label), timeout=LEFT_RUNNING_AFTER,
                 every=0.005)
    except TimeoutError:
        kill_marked(f"{MARK}={label}")
        return time.perf_counter() - started, True
    return time.perf_counter() - started, False


class Longrun:
    name = "longrun"

    def __init__(self, tmp: Path, python: str):
        self.svc = Service(tmp / "longrun-home", poll_interval=1.0, cancel_grace=GRACE, lease_seconds=30)
        self.svc.home.mkdir()
        self.python = python

    def start(self) -> None:
        self.svc.start()

    def stop(self) -> None:
        self.svc.stop()

    def status(self, job: str) -> tuple[str, int]:
        run = self.svc.client.get(f"/v1/runs/{job}").json()
        return run["status"], run["attempt"]

    def submit(self, script: Path, nproc: int, label: str, marks: Path) -> str:
        r = self.svc.client.post("/v1/runs", json={"name": label, "host": "local", "nproc_per_node": nproc,
                                                   "entrypoint": str(script), "args": [str(marks)],
                                                   "env": {MARK: label}})
        r.raise_for_status()
        return r.json()["id"]

    def submit_to_running(self, script: Path, nproc: int, label: str, marks: Path) -> tuple[str, float]:
        t = time.perf_counter()
        job = self.submit(script, nproc, label, marks)
        wait_for("running", lambda: self.status(job) == ("running", 1), every=0.01)
        return job, time.perf_counter() - t

    def restart_to_running(self, job: str, script: Path, nproc: int, label: str, marks: Path) -> tuple[str, float]:
        t = time.perf_counter()
        self.svc.client.post(f"/v1/runs/{job}/restart", json={}).raise_for_status()
        wait_for("attempt 2 running", lambda: self.status(job) == ("running", 2), every=0.01)
        return job, time.perf_counter() - t

    def cancel(self, job: str) -> float:
        t = time.perf_counter()
        self.svc.client.post(f"/v1/runs/{job}/cancel").raise_for_status()
        wait_for("cancelled", lambda: self.status(job)[0] == "cancelled", every=0.005)
        return t

    def status_path(self, job: str) -> str:
        return f"/v1/runs/{job}"

    @property
    def url(self) -> str:
        return self.svc.url


class RayJobs:
    name = "ray"

    def __init__(self, tmp: Path, python: str, venv: Path):
        self.venv, self.python = venv, python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.cluster_mark = f"BENCH_RAY_CLUSTER={uuid.uuid4().hex}"
        # short: Ray puts unix sockets under it
        self.temp = Path(tempfile.mkdtemp(prefix="rayb-", dir="/tmp"))
        self.log = tmp / "ray.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        key, _, value = self.cluster_mark.partition("=")
        # a loaded machine starts the dashboard agent slowly: the raylet's default 15 s wait for it kills the cluster
        env = {**os.environ, key: value, "RAY_USAGE_STATS_ENABLED": "0", "RAY_agent_register_timeout_ms": "300000"}
        argv = [str(self.venv / "bin" / "ray"), "start", "--head", "--block", "--num-cpus=2",
                f"--port={free_port()}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.port}", f"--temp-dir={self.temp}", "--disable-usage-stats"]
        self.proc = subprocess.Popen(argv, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

        def jobs_api_up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited: {self.log.read_text()[-3000:]}")
            try:
                return self.client.get("/api/jobs/").status_code == 200
            except httpx.TransportError:
                return False

        wait_for("Ray's Jobs API", jobs_api_up, timeout=300, every=0.5)

        def job_ran() -> bool:
            # the Jobs API answers before the head node is registered: a job is refused (500) until then
            r = self.client.post("/api/jobs/", json={"entrypoint": "true"})
            if r.status_code != 200:
                return False
            job = r.json()["submission_id"]
            wait_for("a first job", lambda: self.status(job) in ("SUCCEEDED", "FAILED"), timeout=300, every=0.2)
            return True

        wait_for("Ray to run a job", job_ran, timeout=300, every=1.0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        kill_marked(self.cluster_mark)  # what the cluster started in sessions of its own

    def status(self, job: str) -> str:
        return self.client.get(f"/api/jobs/{job}").json()["status"]

    def submit(self, script: Path, nproc: int, label: str, marks: Path) -> str:
        entrypoint = (f"{self.python} -m torch.distributed.run --standalone --nproc-per-node={nproc} "
                      f"{script} {marks}")
        r = self.client.post("/api/jobs/", json={"entrypoint": entrypoint,
                                                 "runtime_env": {"env_vars": {MARK: label}}})
        r.raise_for_status()
        return r.json()["submission_id"]

    def submit_to_running(self, script: Path, nproc: int, label: str, marks: Path) -> tuple[str, float]:
        t = time.perf_counter()
        job = self.submit(script, nproc, label, marks)
        wait_for("RUNNING", lambda: self.status(job) == "RUNNING", every=0.01)
        return job, time.perf_counter() - t

    def restart_to_running(self, job: str, script: Path, nproc: int, label: str, marks: Path) -> tuple[str, float]:
        t = time.perf_counter()
        self.client.post(f"/api/jobs/{job}/stop").raise_for_status()
        wait_for("STOPPED", lambda: self.status(job) in ("STOPPED", "FAILED", "SUCCEEDED"), every=0.01)
        job = self.submit(script, nproc, label, marks)
        wait_for("RUNNING", lambda: self.status(job) == "RUNNING", every=0.01)
        return job, time.perf_counter() - t

    def cancel(self, job: str) -> float:
        t = time.perf_counter()
        self.client.post(f"/api/jobs/{job}/stop").raise_for_status()
        wait_for("STOPPED", lambda: self.status(job) in ("STOPPED", "FAILED", "SUCCEEDED"), every=0.005)
        return t

    def status_path(self, job: str) -> str:
        return f"/api/jobs/{job}"


def ensure_ray(venv: Path) -> str:
    """Ray's version in `venv`, installing it there first when missing."""
    if not (venv / "bin" / "ray").exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "ray[default]"], check=True)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import ray; print(ray.__version__)"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def one_round(system: Any, jobs: Path, rep: int) -> list[dict[str, Any]]:
    rows = []

    def row(measure: str, seconds: float, **extra: Any) -> None:
        rows.append({"system": system.name, "rep": rep, "measure": measure, "seconds": round(seconds, 3), **extra})

    label = f"{system.name}-sleep-{rep}-{uuid.uuid4().hex[:6]}"
    marks = jobs / f"{label}.started"
    job, seconds = system.submit_to_running(jobs / "sleep_job.py", 1, label, marks)
    row("submit → running", seconds)
    wait_for("the job's own start", lambda: started_count(marks) >= 1)
    job, seconds = system.restart_to_running(job, jobs / "sleep_job.py", 1, label, marks)
    row("restart → attempt 2 running", seconds)
    wait_for("attempt 2's own start", lambda: started_count(marks) >= 2)
    asked = system.cancel(job)
    said = time.perf_counter() - asked
    gone, left = until_gone(label, asked)
    row("cancel → verified gone (honours SIGTERM)", gone, terminal_state_s=round(said, 3), left_running=left)

    label = f"{system.name}-stubborn-{rep}-{uuid.uuid4().hex[:6]}"
    marks = jobs / f"{label}.started"
    job, _ = system.submit_to_running(jobs / "stubborn_job.py", 2, label, marks)
    wait_for("both workers' start", lambda: started_count(marks) >= 2)
    asked = system.cancel(job)
    said = time.perf_counter() - asked
    gone, left = until_gone(label, asked)
    row("cancel → verified gone (torchrun, workers ignore SIGTERM)", gone, terminal_state_s=round(said, 3),
        left_running=left)
    return rows


def poll_round(system: Any, jobs: Path, pollers: int, seconds: float) -> dict[str, Any]:
    label = f"{system.name}-poll-{uuid.uuid4().hex[:6]}"
    marks = jobs / f"{label}.started"
    job, _ = system.submit_to_running(jobs / "sleep_job.py", 1, label, marks)
    wait_for("the job's own start", lambda: started_count(marks) >= 1)
    latencies = sorted(asyncio.run(poll_latencies(system.url, system.status_path(job), pollers, seconds, 1.0)))
    system.cancel(job)
    until_gone(label, time.perf_counter())
    ms = [x * 1000 for x in latencies]
    out = {"system": system.name, "measure": "status poll", "pollers": pollers, "requests": len(ms),
           "p50_ms": round(statistics.median(ms), 1), "p99_ms": round(ms[int(len(ms) * 0.99)], 1),
           "max_ms": round(ms[-1], 1)}
    print(json.dumps(out), flush=True)
    return out


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def table(rows: list[dict[str, Any]], polls: list[dict[str, Any]]) -> str:
    measures = list(dict.fromkeys(r["measure"] for r in rows))
    lines = ["| measure | longrun | Ray Jobs |", "|---|---|---|"]
    for measure in measures:
        cells = []
        for system in ("longrun", "ray"):
            got = [r for r in rows if r["measure"] == measure and r["system"] == system]
            secs = [r["seconds"] for r in got]
            left = sum(r.get("left_running", False) for r in got)
            cell = f"{statistics.median(secs):.2f} s ({min(secs):.2f}–{max(secs):.2f})"
            if left:
                cell += f", **{left}/{len(got)} left processes running** {LEFT_RUNNING_AFTER:g} s after"
            said = [r["terminal_state_s"] for r in got if "terminal_state_s" in r]
            if said and left:
                cell += f" (said stopped after {statistics.median(said):.2f} s)"
            cells.append(cell)
        lines.append(f"| {measure} | {cells[0]} | {cells[1]} |")
    for what in ("p50_ms", "p99_ms"):
        cells = []
        for system in ("longrun", "ray"):
            got = [p[what] for p in polls if p["system"] == system]
            cells.append(f"{statistics.median(got):.1f} ms ({min(got):.1f}–{max(got):.1f})")
        lines.append(f"| status poll {what[:3]}, {polls[0]['pollers']} pollers | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--pollers", type=int, default=100)
    p.add_argument("--poll-seconds", type=float, default=15)
    p.add_argument("--poll-rounds", type=int, default=2, help="poll measurements per system, alternating")
    p.add_argument("--ray-venv", type=Path, default=Path("/tmp/rayvenv"))
    args = p.parse_args()
    ray_version = ensure_ray(args.ray_venv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    began, load_before = datetime.now(UTC), load()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        jobs = tmp / "jobs"
        jobs.mkdir()
        (jobs / "sleep_job.py").write_text(SLEEP_JOB)
        (jobs / "stubborn_job.py").write_text(STUBBORN_JOB)
        systems = [Longrun(tmp, sys.executable), RayJobs(tmp, sys.executable, args.ray_venv)]
        rows: list[dict[str, Any]] = []
        polls: list[dict[str, Any]] = []
        try:
            for system in systems:
                system.start()
                one_round(system, jobs, -1)  # warm-up, not counted: the first job pays each system's own start-up
            for rep in range(args.repeat):
                for system in systems if rep % 2 == 0 else systems[::-1]:
                    for row in one_round(system, jobs, rep):
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            for n in range(args.poll_rounds):
                for system in systems if n % 2 == 0 else systems[::-1]:
                    polls.append(poll_round(system, jobs, args.pollers, args.poll_seconds))
        finally:
            for system in systems:
                system.stop()
            kill_marked(f"{MARK}=", prefix=True)
    ended, load_after = datetime.now(UTC), load()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"\n{began:%Y-%m-%d %H:%M}–{ended:%H:%M} UTC, longrun {commit}, Ray {ray_version}, Python "
          f"{platform.python_version()}, {os.cpu_count()} cores ({cpu}), load average {load_before} before, "
          f"{load_after} after; medians of {args.repeat} (min–max), polls {args.poll_rounds} × "
          f"{args.poll_seconds:g} s per system\n")
    print(table(rows, polls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
