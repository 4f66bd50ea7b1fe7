"""API writes beside metric ingest, on each store (SQLite, PostgreSQL): one `longrun serve` with its worker.

    python benchmarks/bench_write_beside_ingest.py                    # both stores, the defaults below
    python benchmarks/bench_write_beside_ingest.py --stores sqlite --jobs 0   # the same clients, no ingest beside

`--jobs` jobs on the `local` host each write `--points` metric points every `--every` seconds (lines of 23 fields),
which the worker ingests; once they are flowing, `--clients` clients at once each send `--requests` requests, a
third of them writes (a submit repeating an Idempotency-Key, answered 200, or a cancel of a run already over,
answered 409: each a write transaction in the API's write line) and the rest reads (a run, the list). A write
that answers 5xx or not within `--timeout` s failed. Prints one JSON line per store: write and read p50/p99/max,
writes failed, and the points a second the jobs write and the worker stored meanwhile. Loopback only; it stops by itself
(bounded requests, the jobs cancelled, the server stopped). PostgreSQL is a throw-away cluster from Debian's
binaries (tests/postgres.py).
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_load import _ms  # noqa: E402
from bench_service import FIELDS  # noqa: E402

from tests.service import Service, kill_leftovers, toy_spec  # noqa: E402

# every `every` seconds, enough lines of FIELDS to make `points` points, for `seconds` seconds
BURSTS = """
import json, os, sys, time
points, every, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
fields = json.loads(sys.argv[4])
per_line = len(fields) + 4
step, end = 0, time.time() + seconds
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
    while time.time() < end:
        for _ in range(max(1, points // per_line)):
            step += 1
            row = {"step": step, "total_steps": 10**9, "epoch": 0.0, "time": time.time()}
            row.update({k: 1.0 / step for k in fields})
            f.write(json.dumps(row) + "\\n")
        f.flush()
        time.sleep(every)
"""


def stored_lines(svc: Service, run_ids: list[str]) -> int:
    """Metric lines of the jobs stored so far (each job's latest step: one line a step)."""
    return sum((svc.run(r)["latest"].get("step") or 0) for r in run_ids)


def bench(svc: Service, args: argparse.Namespace, script: Path) -> dict:
    import httpx

    key = "bench-write-beside-ingest"
    ended = svc.submit(toy_spec(steps=1, sleep=0, nproc=1, name="ended"), headers={"Idempotency-Key": key})["id"]
    svc.wait_status(ended, "succeeded", timeout=300)
    jobs = [svc.submit({"name": f"ingest-{n}", "host": "local", "nproc_per_node": 1, "entrypoint": str(script),
                        "args": [str(args.points), str(args.every), "3600", json.dumps(FIELDS)]})["id"]
            for n in range(args.jobs)]
    for run_id in jobs:
        svc.wait(run_id, lambda r: (r["latest"].get("step") or 0) > 0, timeout=300, what="metrics flowing")
    before = stored_lines(svc, jobs)
    reads: list[float] = []
    writes: list[float] = []
    failed: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(args.clients)

    def timed(into: list[float], send) -> None:  # noqa: ANN001
        t = time.perf_counter()
        try:
            r = send()
            ok, what = r.status_code < 500, f"{r.status_code} {r.text[:100]}"
        except httpx.HTTPError as exc:
            ok, what = False, type(exc).__name__
        with lock:
            into.append(time.perf_counter() - t)
            if not ok:
                failed.append(what)

    def client(index: int) -> None:
        with httpx.Client(base_url=svc.url, timeout=args.timeout) as c:
            start.wait()
            for i in range(args.requests):
                if (index + i) % 3:
                    path = f"/v1/runs/{jobs[index % len(jobs)] if jobs else ended}" if i % 2 else "/v1/runs"
                    timed(reads, lambda path=path: c.get(path, params={"limit": 20}))
                elif index % 2:
                    timed(writes, lambda: c.post("/v1/runs", json=toy_spec(steps=1, sleep=0, nproc=1, name="ended"),
                                                 headers={"Idempotency-Key": key}))
                else:
                    timed(writes, lambda: c.post(f"/v1/runs/{ended}/cancel"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stored = stored_lines(svc, jobs) - before
    for run_id in jobs:
        svc.client.post(f"/v1/runs/{run_id}/cancel")
    for run_id in jobs:
        svc.wait_status(run_id, "cancelled", "failed", timeout=120)
    per_line = len(FIELDS) + 4
    return {"jobs": args.jobs, "job_points_per_s": round(args.jobs * (args.points // per_line) * per_line / args.every),
            "stored_points_per_s": round(stored * per_line / wall), "clients": args.clients,
            "requests": len(reads) + len(writes), "wall_s": round(wall, 1), "writes": len(writes),
            "failed": len(failed), "failures": sorted(set(failed))[:5], "write": _ms(writes), "read": _ms(reads)}


@contextmanager
def database(store: str, tmp: Path) -> Iterator[str]:
    """The URL of a fresh database in `store`: a SQLite file, or one of a throw-away PostgreSQL cluster."""
    if store == "sqlite":
        yield f"sqlite:///{tmp / 'longrun.sqlite'}"
        return
    from tests.postgres import PostgresCluster

    cluster = PostgresCluster().start()
    try:
        yield cluster.create_database(migrated=False)
    finally:
        cluster.stop()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stores", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"])
    p.add_argument("--jobs", type=int, default=2, help="jobs writing metrics beside the clients (0: none)")
    p.add_argument("--points", type=int, default=500, help="metric points each job writes at a time")
    p.add_argument("--every", type=float, default=0.05, help="seconds between a job's writes")
    p.add_argument("--clients", type=int, default=100, help="clients at once")
    p.add_argument("--requests", type=int, default=5, help="requests each client sends, a third of them writes")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take before it failed")
    args = p.parse_args()
    for store in args.stores:
        with tempfile.TemporaryDirectory() as name, database(store, Path(name)) as url:
            svc = Service(Path(name) / "home", database_url=url)
            svc.home.mkdir()
            script = Path(name) / "bursts.py"
            script.write_text(BURSTS)
            try:
                svc.start()
                print(json.dumps({"store": store, **bench(svc, args, script)}), flush=True)
            finally:
                svc.stop()
                kill_leftovers(svc.workspace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
