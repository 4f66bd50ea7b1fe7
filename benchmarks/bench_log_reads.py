"""Log reads against a big log: what 4 concurrent `GET /v1/runs/{id}/logs` cost the server.

A job on the `local` host writes `--log-mib` MiB of log lines (and one `--giant-mib` MiB line near its end) and
exits; the real server and worker ingest it, keeping its last 64 MiB. Then, 4 at once, `?tail=200` and then
`?since_offset=0` (one answer each, as the API gives it): the server process's peak RSS over each phase (VmHWM,
reset before it through /proc/PID/clear_refs) and the bytes each answer holds. Loopback only, bounded by
`--timeout`; prints one JSON line per phase.

    python benchmarks/bench_log_reads.py                 # 1 GiB written, 64 MiB kept
    python benchmarks/bench_log_reads.py --log-mib 256   # quicker

Run it on two checkouts (before and after a change) on the same machine to compare.
"""

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.service import STUB_ENV, Service  # noqa: E402

JOB = """
import os, sys
mib, giant = int(sys.argv[1]), int(sys.argv[2])
line = ("x" * 90 + "\\n").encode()
block = line * ((1 << 20) // len(line))
out = sys.stdout.buffer
if os.environ.get("RANK", "0") == "0":
    for i in range(mib):
        out.write(b"step %d " % i + block)
        if i == mib - 2 and giant:
            out.write(b"y" * (giant << 20) + b"\\n")
    out.write(b"the last line\\n")
    out.flush()
"""


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _phase(svc: Service, pid: int, run_id: str, params: dict, readers: int, timeout: float) -> dict:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM from here on
    before = _status_kib(pid, "VmRSS")
    sizes: list[int] = []
    errors: list[str] = []

    def read() -> None:
        try:
            r = httpx.get(f"{svc.url}/v1/runs/{run_id}/logs", params=params, timeout=timeout)
            sizes.append(len(r.content))
        except httpx.HTTPError as exc:
            errors.append(str(exc))

    started = time.monotonic()
    threads = [threading.Thread(target=read) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return {"phase": "&".join(f"{k}={v}" for k, v in params.items()), "readers": readers,
            "rss_before_mib": round(before / 1024, 1), "rss_peak_mib": round(_status_kib(pid, "VmHWM") / 1024, 1),
            "bytes_each": sorted(sizes), "seconds": round(time.monotonic() - started, 2), "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-mib", type=int, default=1024, help="MiB of log the job writes")
    parser.add_argument("--giant-mib", type=int, default=10, help="MiB of one line near the log's end (0: none)")
    parser.add_argument("--readers", type=int, default=4, help="concurrent reads per phase")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the ingest and for each read")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        (home / "job.py").write_text(JOB)
        svc = Service(home).start()
        try:
            run = svc.submit({"name": "big-log", "host": "local", "nproc_per_node": 1,
                              "entrypoint": str(home / "job.py"), "args": [str(args.log_mib), str(args.giant_mib)],
                              "env": STUB_ENV})
            t0 = time.monotonic()
            done = svc.wait_status(run["id"], "succeeded", "failed", "cancelled", timeout=args.timeout)
            print(json.dumps({"phase": "ingest", "status": done["status"], "log_mib": args.log_mib,
                              "seconds": round(time.monotonic() - t0, 1)}), flush=True)
            pid = svc.proc.pid
            for params in ({"tail": 200}, {"since_offset": 0}):
                print(json.dumps(_phase(svc, pid, run["id"], params, args.readers, args.timeout)), flush=True)
        finally:
            svc.stop()


if __name__ == "__main__":
    main()
