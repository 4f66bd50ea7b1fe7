"""Reading a run of many stored points from a real `longrun serve` (SQLite): its memory and time.

    python benchmarks/bench_metrics_read.py --points 10000000 --readers 4

Stores `--points` points of one series (`loss`) under an ended run straight into a fresh migrated SQLite file
(tests/bulk_points.py), starts the server on it, then measures: the page's thinned read (2000 points), the answer to
`limit=1000000` (a 422 since answers hold at most 20,000 points), `--readers` clients each reading every point
through the pages (longrun.Client.metrics follows next_cursor), /healthz answered meanwhile, and the server's RSS
before and at its peak (VmHWM). Prints one JSON line. tests/server/test_store_big_read.py is the same at 1M points.
"""

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from longrun import Client  # noqa: E402
from server.db import upgrade  # noqa: E402
from tests.bulk_points import ended_run, rss_mib, store_points  # noqa: E402
from tests.service import Service  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--points", type=int, default=10_000_000)
    p.add_argument("--readers", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "longrun.db"
        url = f"sqlite:///{path}"
        upgrade(url)
        run_id = ended_run(url)
        t0 = time.perf_counter()
        store_points(path, run_id, ["loss"], args.points)
        stored_s = time.perf_counter() - t0
        svc = Service(Path(tmp) / "home", database_url=url)
        svc.home.mkdir()
        svc.start()
        try:
            pid = svc.proc.pid
            before, _ = rss_mib(pid)
            t0 = time.perf_counter()
            thinned = svc.series(run_id, "loss")
            thinned_s = time.perf_counter() - t0
            whole = svc.client.get(f"/v1/runs/{run_id}/metrics", params={"names": "loss", "limit": 1_000_000})
            took: list[float] = []
            health: list[float] = []
            done = threading.Event()

            def read() -> None:
                start = time.perf_counter()
                with Client(svc.url, timeout=600) as client:
                    got = client.metrics(run_id, names=["loss"], limit=args.points)["loss"]
                assert len(got) == args.points, len(got)
                took.append(time.perf_counter() - start)

            def watch_health() -> None:
                while not done.is_set():
                    start = time.perf_counter()
                    svc.client.get("/healthz")
                    health.append(time.perf_counter() - start)
                    time.sleep(0.5)

            watcher = threading.Thread(target=watch_health)
            watcher.start()
            readers = [threading.Thread(target=read) for _ in range(args.readers)]
            t0 = time.perf_counter()
            for t in readers:
                t.start()
            for t in readers:
                t.join()
            wall = time.perf_counter() - t0
            done.set()
            watcher.join()
            _, peak = rss_mib(pid)
        finally:
            svc.stop()
    print(json.dumps({
        "bench": "metrics_read", "points": args.points, "store_s": round(stored_s, 1),
        "thinned_points": len(thinned), "thinned_s": round(thinned_s, 2),
        "limit_1000000": whole.status_code, "readers": args.readers, "read_every_point_s": [round(x, 1) for x in took],
        "points_per_s_all_readers": round(args.points * args.readers / wall),
        "healthz_p50_ms": round(statistics.median(health) * 1000, 1), "healthz_max_ms": round(max(health) * 1000, 1),
        "rss_before_mib": round(before), "rss_peak_mib": round(peak)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
