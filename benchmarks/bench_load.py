"""Load on each store (SQLite, PostgreSQL): one `longrun serve --no-worker` and separate `longrun worker`s.

    python benchmarks/bench_load.py                       # both stores, the defaults below
    python benchmarks/bench_load.py --stores postgres --runs 50 --workers 4 --rate 530 --points 1000000

Per store, on a fresh database:
  lifecycle  `--runs` sleep-and-report jobs submitted at once, round-robin over the `local` host and `--ssh-hosts`
             SSH hosts (each a real sshd in a network namespace of its own): submit -> running (seen by a
             client polling every 50 ms), then each cancelled: cancel -> cancelled (the worker's verdict that
             no process of the run remains);
  poll       `--pollers` clients each calling GET /v1/runs/{id} once a second for `--seconds`, while a job writes
             `--rate` metric lines/s of 19 fields (530 lines/s: about 10,000 points/s) and the workers ingest;
  clients    `--clients` clients at once, each `--rounds` times 5 reads and a write (a repeated submit or a
             cancel), while a job writes a metric line every 10 ms: write and read p50/p99, writes failed (5xx or
             no answer within 60 s);
  size       `--points` metric points stored through the worker's ingest path (worker.ingest.store_metrics),
             and the database's size after them.
Prints one JSON line per measurement. PostgreSQL is a throw-away cluster from Debian's binaries (tests/postgres.py).
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_service import FIELDS, FIREHOSE, poll_latencies  # noqa: E402

from tests.service import Service, kill_leftovers, start_worker, stop_processes  # noqa: E402

SLEEP_AND_REPORT = """
import json, os, time
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
    for step in range(1, 100000):
        f.write(json.dumps({"step": step, "total_steps": 100000, "time": time.time(), "loss": 1.0 / step}) + "\\n")
        f.flush()
        time.sleep(1.0)
"""


def _ms(seconds: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in seconds)
    return {"p50_ms": round(statistics.median(ms), 1), "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 1),
            "max_ms": round(ms[-1], 1)}


def _until(svc: Service, run_ids: list[str], statuses: set[str], timeout: float) -> dict[str, float]:
    """When each run was first seen in one of `statuses`, by a client listing the runs every 50 ms."""
    seen: dict[str, float] = {}
    deadline = time.perf_counter() + timeout
    while len(seen) < len(run_ids):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{len(run_ids) - len(seen)} runs not {statuses} after {timeout}s")
        now = time.perf_counter()
        for run in svc.client.get("/v1/runs", params={"limit": 500}).json()["items"]:
            if run["id"] in run_ids and run["status"] in statuses:
                seen.setdefault(run["id"], now)
        time.sleep(0.05)
    return seen


def bench_lifecycle(svc: Service, runs: int, script: Path, hosts: list[str]) -> dict:
    """`runs` runs spread round-robin over `hosts`."""
    spec = {"nproc_per_node": 1, "entrypoint": str(script)}
    submitted = {}
    for i in range(runs):
        t = time.perf_counter()
        submitted[svc.submit({**spec, "host": hosts[i % len(hosts)], "name": f"load-{i}"})["id"]] = t
    running = _until(svc, list(submitted), {"running"}, timeout=600)
    asked = {}
    for run_id in submitted:
        asked[run_id] = time.perf_counter()
        svc.client.post(f"/v1/runs/{run_id}/cancel").raise_for_status()
    gone = _until(svc, list(submitted), {"cancelled"}, timeout=600)
    start = [running[r] - submitted[r] for r in submitted]
    cancel = [gone[r] - asked[r] for r in submitted]
    return {"bench": "lifecycle", "runs": runs, "hosts": len(hosts), "submit_to_running": _ms(start),
            "cancel_to_gone": _ms(cancel)}


def ssh_hosts(svc: Service, count: int, stack: ExitStack) -> list[str]:
    """`count` SSH hosts, each a real sshd in a network namespace of its own on one private bridge,
    registered with the service (its workspace a directory of this machine: namespaces share the filesystem)."""
    if count == 0:
        return []
    from tests.netns import PrivateNetwork
    from tests.sshd import SshServer

    net = stack.enter_context(PrivateNetwork())
    names = []
    for n in range(count):
        sshd = stack.enter_context(SshServer(netns=stack.enter_context(net.namespace())))
        workspace = svc.home.parent / f"ssh{n}"
        workspace.mkdir()
        stack.callback(kill_leftovers, workspace)
        body = {"name": f"ssh{n}", **sshd.host_fields, "workspace": str(workspace), "python": sys.executable}
        svc.client.post("/v1/hosts", json=body).raise_for_status()
        names.append(f"ssh{n}")
    return names


def bench_poll(svc: Service, pollers: int, seconds: float, rate: float, script: Path) -> dict:
    run = svc.submit({"name": "firehose", "host": "local", "nproc_per_node": 1, "entrypoint": str(script),
                      "args": [str(rate), str(seconds + 60), json.dumps(FIELDS)]})
    svc.wait(run["id"], lambda r: (r["latest"].get("step") or 0) > rate, what="metrics flowing", timeout=300)
    before = svc.run(run["id"])["latest"]["step"]
    latencies = asyncio.run(poll_latencies(svc.url, f"/v1/runs/{run['id']}", pollers, seconds, 1.0))
    after = svc.run(run["id"])["latest"]["step"]
    svc.client.post(f"/v1/runs/{run['id']}/cancel")
    return {"bench": "poll", "pollers": pollers, "seconds": seconds, "requests": len(latencies),
            "job_points_per_s": round(rate * len(FIELDS)),
            "ingested_points_per_s": round((after - before) * len(FIELDS) / seconds), **_ms(latencies)}


def bench_size(database_url: str, points: int, size_of) -> dict:  # noqa: ANN001
    from server.db import Database
    from server.models import Attempt, Run
    from worker.ingest import store_metrics

    db = Database(database_url)
    with db.writing() as s:
        s.add(Run(id="size", name="size", status="running", spec={}, hosts=["local"], latest={}, attempt=1))
        s.add(Attempt(run_id="size", number=1, spec={}, token="t", nodes=[], metrics_lines=0))
    empty = size_of()
    lines, batch = points // len(FIELDS), 1000
    t0 = time.perf_counter()
    for start in range(1, lines + 1, batch):
        text = "".join(json.dumps({"step": i, "time": 1e9 + i, **{k: 1.0 / i for k in FIELDS}}) + "\n"
                       for i in range(start, min(start + batch, lines + 1)))
        with db.writing() as s:
            store_metrics(s, s.get(Run, "size"), s.query(Attempt).filter_by(run_id="size").one(), text)
    seconds = time.perf_counter() - t0
    db.dispose()
    grown = size_of() - empty
    stored = lines * len(FIELDS)
    return {"bench": "size", "points": stored, "ingest_points_per_s": round(stored / seconds),
            "database_mb": round(size_of() / 2**20, 1), "bytes_per_point": round(grown / stored, 1)}


def bench_clients(svc: Service, clients: int, rounds: int, timeout: float = 60.0) -> dict:
    """`clients` threads at once, each `rounds` times: what watchers, the page and the CLI send (a run, the list,
    metrics, logs, a restart dry run) and one write (a submit under a repeated Idempotency-Key, or a cancel of a run
    already over), while a job writes a metric line every 10 ms. A write that times out (`timeout`) or answers 5xx
    failed; the others are the answers asked for (201/200, 409)."""
    import threading

    import httpx

    from tests.service import toy_spec

    running = svc.submit(toy_spec(steps=100_000, sleep=0.01, nproc=1, name="ingesting"))["id"]
    key = "bench-clients"
    ended = svc.submit(toy_spec(steps=1, sleep=0, nproc=1, name="ended"), headers={"Idempotency-Key": key})["id"]
    svc.wait_status(ended, "succeeded", timeout=300)
    svc.wait(running, lambda r: (r["latest"].get("step") or 0) > 10, timeout=300, what="steps stored")
    reads: list[float] = []
    writes: list[float] = []
    failed: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def timed(into: list[float], send) -> None:  # noqa: ANN001
        t = time.perf_counter()
        try:
            r = send()
            ok = r.status_code < 500
            what = f"{r.status_code} {r.text[:100]}"
        except httpx.HTTPError as exc:
            ok, what = False, f"{type(exc).__name__}"
        with lock:
            into.append(time.perf_counter() - t)
            if not ok:
                failed.append(what)

    def client(index: int) -> None:
        with httpx.Client(base_url=svc.url, timeout=timeout) as c:
            start.wait()
            for _ in range(rounds):
                timed(reads, lambda: c.get(f"/v1/runs/{running}"))
                timed(reads, lambda: c.get("/v1/runs", params={"limit": 20}))
                timed(reads, lambda: c.get(f"/v1/runs/{running}/metrics", params={"names": "loss", "limit": 500}))
                timed(reads, lambda: c.get(f"/v1/runs/{running}/logs", params={"tail": 5}))
                timed(reads, lambda: c.post(f"/v1/runs/{ended}/restart", params={"dry_run": "true"},
                                            json={"overrides": {}}))
                if index % 2:
                    timed(writes, lambda: c.post("/v1/runs", json=toy_spec(steps=1, sleep=0, nproc=1, name="ended"),
                                                 headers={"Idempotency-Key": key}))
                else:
                    timed(writes, lambda: c.post(f"/v1/runs/{ended}/cancel"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    svc.client.post(f"/v1/runs/{running}/cancel")
    return {"bench": "clients", "clients": clients, "requests": len(reads) + len(writes), "wall_s": round(wall, 1),
            "writes": len(writes), "failed": len(failed), "failures": sorted(set(failed))[:5],
            "write": _ms(writes), "read": _ms(reads)}


def run_store(store: str, args: argparse.Namespace, tmp: Path) -> None:
    cluster = None
    if store == "postgres":
        from tests.postgres import PostgresCluster

        cluster = PostgresCluster().start()
        url = cluster.create_database(migrated=False)

        def size_of() -> int:
            import psycopg

            with psycopg.connect(host="127.0.0.1", port=cluster.port, user="postgres", dbname="postgres") as c:
                return c.execute("SELECT pg_database_size(%s)", (url.rsplit("/", 1)[1],)).fetchone()[0]
    else:
        path = tmp / "longrun.sqlite"
        url = f"sqlite:///{path}"

        def size_of() -> int:
            import sqlite3

            with sqlite3.connect(path) as c:  # the write-ahead log folded into the file first
                c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return path.stat().st_size

    svc = Service(tmp / "home", database_url=url, poll_interval=0.5, lease_seconds=30)
    svc.home.mkdir()
    (tmp / "report.py").write_text(SLEEP_AND_REPORT)
    (tmp / "firehose.py").write_text(FIREHOSE)
    workers = []
    with ExitStack() as hosts:  # the SSH hosts go last, once the workers that reach them have stopped
        try:
            svc.start(worker=not args.workers)  # --workers 0: `longrun serve` with its embedded worker
            workers = [start_worker(svc, f"worker{n}") for n in range(args.workers)]
            names = ["local", *ssh_hosts(svc, args.ssh_hosts, hosts)]
            phases = {"lifecycle": lambda: bench_lifecycle(svc, args.runs, tmp / "report.py", names),
                      "poll": lambda: bench_poll(svc, args.pollers, args.seconds, args.rate, tmp / "firehose.py"),
                      "clients": lambda: bench_clients(svc, args.clients, args.rounds)}
            for phase in args.phases:
                print(json.dumps({"store": store, "workers": args.workers, **phases[phase]()}), flush=True)
        finally:
            stop_processes(workers)
            svc.stop()
            kill_leftovers(svc.workspace)
    try:
        if "size" in args.phases:
            print(json.dumps({"store": store, **bench_size(url, args.points, size_of)}), flush=True)
    finally:
        if cluster:
            cluster.stop()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stores", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"])
    p.add_argument("--runs", type=int, default=20, help="sleep-and-report runs submitted at once")
    p.add_argument("--workers", type=int, default=2, help="`longrun worker` processes; 0: the server's own worker")
    p.add_argument("--ssh-hosts", type=int, default=0,
                   help="SSH hosts besides `local`, each an sshd in a network namespace (root, iproute2, openssh-server)")
    p.add_argument("--pollers", type=int, default=100)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rate", type=float, default=530, help="metric lines/s of 19 fields the firehose job writes")
    p.add_argument("--points", type=int, default=1_000_000)
    p.add_argument("--clients", type=int, default=100, help="clients at once in the clients phase")
    p.add_argument("--rounds", type=int, default=3, help="rounds of 5 reads and a write each client sends")
    p.add_argument("--phases", nargs="+", choices=["lifecycle", "poll", "clients", "size"],
                   default=["lifecycle", "poll", "clients", "size"])
    args = p.parse_args()
    for store in args.stores:
        with tempfile.TemporaryDirectory() as tmp:
            run_store(store, args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
