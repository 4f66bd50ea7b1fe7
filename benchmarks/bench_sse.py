"""What open event streams cost the rest of the API: `GET /v1/runs/{id}` and `GET /v1/runs` with no stream open,
then with `--streams` clients following the run's events (`GET /v1/runs/{id}/events`), on a real `longrun serve`
(SQLite) whose run writes a metric line a second (an event a second to every stream).

    python benchmarks/bench_sse.py --streams 500 --seconds 20

Prints one JSON line: p50/p99 of both reads idle and with the streams open, their ratio, and the events each stream
received meanwhile.
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_load import SLEEP_AND_REPORT  # noqa: E402

from tests.service import Service  # noqa: E402


def _reads(svc: Service, path: str, seconds: float) -> dict[str, float]:
    """One client reading `path` back to back for `seconds`: p50 and p99 in ms."""
    took = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t = time.perf_counter()
        svc.client.get(path).raise_for_status()
        took.append((time.perf_counter() - t) * 1000)
        time.sleep(0.05)
    took.sort()
    return {"p50_ms": round(statistics.median(took), 1), "p99_ms": round(took[int(len(took) * 0.99)], 1),
            "requests": len(took)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--seconds", type=float, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "report.py"
        script.write_text(SLEEP_AND_REPORT)
        svc = Service(Path(tmp) / "home")
        svc.home.mkdir()
        svc.start()
        try:
            run = svc.submit({"name": "followed", "host": "local", "nproc_per_node": 1, "entrypoint": str(script)})
            svc.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 2, what="steps stored", timeout=300)
            one, page = f"/v1/runs/{run['id']}", "/v1/runs"
            idle = {"run": _reads(svc, one, args.seconds / 2), "list": _reads(svc, page, args.seconds / 2)}
            events = [0] * args.streams
            opened, stop = threading.Event(), threading.Event()

            async def follow(client: httpx.AsyncClient, i: int) -> None:
                async with client.stream("GET", f"/v1/runs/{run['id']}/events") as r:
                    async for line in r.aiter_lines():
                        if line.startswith("id:"):
                            events[i] += 1
                        if stop.is_set():
                            return

            async def streams() -> None:
                limits = httpx.Limits(max_connections=args.streams + 1, max_keepalive_connections=0)
                async with httpx.AsyncClient(base_url=svc.url, limits=limits, timeout=600) as client:
                    tasks = [asyncio.create_task(follow(client, i)) for i in range(args.streams)]
                    while not all(events):
                        await asyncio.sleep(0.1)
                    opened.set()
                    await asyncio.gather(*tasks)

            thread = threading.Thread(target=asyncio.run, args=(streams(),), daemon=True)
            thread.start()
            assert opened.wait(300), "the streams did not all open"
            before = sum(events)
            loaded = {"run": _reads(svc, one, args.seconds / 2), "list": _reads(svc, page, args.seconds / 2)}
            during = (sum(events) - before) / args.streams
            stop.set()
            svc.client.post(f"/v1/runs/{run['id']}/cancel")
            thread.join(60)
        finally:
            svc.stop()
    print(json.dumps({"bench": "sse", "streams": args.streams, "idle": idle, "with_streams": loaded,
                      "run_p50_ratio": round(loaded["run"]["p50_ms"] / idle["run"]["p50_ms"], 2),
                      "list_p50_ratio": round(loaded["list"]["p50_ms"] / idle["list"]["p50_ms"], 2),
                      "events_per_stream_meanwhile": round(during, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
