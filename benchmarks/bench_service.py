"""Service benchmarks: metric ingest rate into SQLite, and status-poll latency under load.

    python benchmarks/bench_service.py ingest   # points/s through worker.ingest.store_metrics
    python benchmarks/bench_service.py poll     # p50/p99 of GET /v1/runs/{id}: 100 pollers, each once a
                                                # second like `longrun watch`, while a job streams metrics
                                                # through the real server and worker

Prints one JSON line per measurement.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIELDS = ["loss"] + [f"{k}_{i}" for k in ("loss", "acc", "cond_acc") for i in range(5)] + ["lr", "grad_norm",
                                                                                          "tokens_per_s"]

FIREHOSE = """
import json, os, sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
fields = json.loads(sys.argv[3])
total = int(rate * seconds)
with open(os.environ["LONGRUN_METRICS_FILE"], "a") as f:
    t0 = time.time()
    for step in range(1, total + 1):
        row = {"step": step, "total_steps": total, "epoch": step / total, "time": time.time()}
        row.update({k: 1.0 / step for k in fields})
        f.write(json.dumps(row) + "\\n")
        if step % 50 == 0:
            f.flush()
            time.sleep(max(0.0, t0 + step / rate - time.time()))
"""


def bench_ingest(lines: int, batch: int) -> dict:
    from server.db import Database
    from server.models import Attempt, Run
    from worker.ingest import store_metrics

    with tempfile.TemporaryDirectory() as tmp:
        db = Database(f"sqlite:///{tmp}/bench.db")
        db.migrate()
        with db.writing() as s:
            s.add(Run(id="r", name="bench", status="running", spec={}, hosts=["local"], latest={}, attempt=1))
            s.add(Attempt(run_id="r", number=1, spec={}, token="t", nodes=[], metrics_lines=0))
        text_batches = []
        for start in range(1, lines + 1, batch):
            rows = [json.dumps({"step": i, "total_steps": lines, "time": 1e9 + i, **{k: 1.0 / i for k in FIELDS}})
                    for i in range(start, min(start + batch, lines + 1))]
            text_batches.append("\n".join(rows) + "\n")
        t0 = time.perf_counter()
        for text in text_batches:
            with db.writing() as s:
                store_metrics(s, s.get(Run, "r"), s.get(Attempt, 1), text)
        seconds = time.perf_counter() - t0
    points = lines * len(FIELDS)
    return {"bench": "ingest", "lines": lines, "batch_lines": batch, "points": points,
            "seconds": round(seconds, 3), "points_per_s": round(points / seconds)}


async def poll_latencies(url: str, path: str, pollers: int, seconds: float, interval: float) -> list[float]:
    """Seconds per `GET url+path`, from `pollers` concurrent clients each asking every `interval` seconds."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=pollers, max_keepalive_connections=pollers)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
        stop = time.perf_counter() + seconds

        async def poller(i: int) -> None:
            # spread the pollers over the interval, as independent watchers would be
            await asyncio.sleep(interval * i / pollers)
            while time.perf_counter() < stop:
                t = time.perf_counter()
                r = await client.get(path)
                r.raise_for_status()
                latencies.append(time.perf_counter() - t)
                await asyncio.sleep(max(0.0, interval - (time.perf_counter() - t)))

        await asyncio.gather(*(poller(i) for i in range(pollers)))
    return latencies


def bench_poll(pollers: int, seconds: float, rate: float, interval: float) -> dict:
    from tests.service import Service

    with tempfile.TemporaryDirectory() as tmp:
        svc = Service(Path(tmp) / "home")
        svc.home.mkdir()
        svc.env["LONGRUN_POLL_INTERVAL"] = "0.5"
        svc.start()
        script = Path(tmp) / "firehose.py"
        script.write_text(FIREHOSE)
        try:
            run = svc.submit({"name": "firehose", "host": "local", "nproc_per_node": 1, "entrypoint": str(script),
                              "args": [str(rate), str(seconds + 30), json.dumps(FIELDS)]})
            svc.wait(run["id"], lambda r: (r["latest"].get("step") or 0) > rate, what="metrics flowing")
            before = svc.run(run["id"])["latest"]["step"]
            latencies = asyncio.run(poll_latencies(svc.url, f"/v1/runs/{run['id']}", pollers, seconds, interval))
            after = svc.run(run["id"])["latest"]["step"]
        finally:
            svc.stop()
            from tests.service import kill_leftovers

            kill_leftovers(svc.workspace)
    latencies.sort()
    ms = [x * 1000 for x in latencies]
    ingested = (after - before) * len(FIELDS) / seconds
    return {"bench": "poll", "pollers": pollers, "poll_interval_s": interval, "seconds": seconds, "requests": len(ms),
            "requests_per_s": round(len(ms) / seconds), "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(ms[int(len(ms) * 0.99)], 1), "max_ms": round(ms[-1], 1),
            "ingest_points_per_s_meanwhile": round(ingested)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["ingest", "poll", "all"])
    p.add_argument("--lines", type=int, default=20000)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--pollers", type=int, default=100)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rate", type=float, default=200, help="metric lines per second the job writes")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between one poller's requests (`longrun watch` polls once a second); 0: flat out")
    args = p.parse_args()
    os.chdir(ROOT)
    if args.what in ("ingest", "all"):
        print(json.dumps(bench_ingest(args.lines, args.batch)), flush=True)
    if args.what in ("poll", "all"):
        print(json.dumps(bench_poll(args.pollers, args.seconds, args.rate, args.interval)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
