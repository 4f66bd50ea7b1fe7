"""`make demo`: the whole loop on this machine, through the REST API as a user would drive it.

Starts `longrun serve` (embedded SQLite, the `local` host) under .demo/, submits a run, shows it
live, asks what a restart with a changed setting would cost (dry run), restarts it, and shows the
second attempt finish with the prediction checked against what it really took.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / ".demo"
sys.path.insert(0, str(ROOT))

from server.cli import progress_line  # noqa: E402

TERMINAL = {"succeeded", "failed", "cancelled"}


def say(text: str) -> None:
    print(f"\n== {text}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Demo:
    def __init__(self) -> None:
        self.home = DEMO / "home"
        shutil.rmtree(self.home, ignore_errors=True)
        self.home.mkdir(parents=True)
        self.port = free_port()
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        self.server: subprocess.Popen | None = None

    def start_server(self) -> None:
        env = {**os.environ, "LONGRUN_HOME": str(self.home), "LONGRUN_PORT": str(self.port),
               "LONGRUN_POLL_INTERVAL": "0.5"}
        log = open(self.home / "server.log", "wb")
        self.server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve"], cwd=ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)
        for _ in range(300):
            try:
                if self.api.get("/healthz").status_code == 200:
                    print(f"longrun serve on http://127.0.0.1:{self.port} (LONGRUN_HOME={self.home})")
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        sys.exit(f"the server did not start; see {self.home / 'server.log'}")

    def stop_server(self) -> None:
        if self.server and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(15)

    def call(self, method: str, path: str, **kw: Any) -> Any:
        r = self.api.request(method, path, **kw)
        if r.status_code >= 400:
            sys.exit(f"{method} {path}: {r.status_code} {r.text}")
        return r.json()

    def watch(self, run_id: str, until: Any = None, every: float = 2.0) -> dict[str, Any]:
        shown = None
        while True:
            run = self.call("GET", f"/v1/runs/{run_id}")
            if (run["status"], run["attempt"]) != shown:
                shown = (run["status"], run["attempt"])
                print(f"  {run['status']} (attempt {run['attempt']})" + (f": {run['message']}" if run["message"] else ""))
            print("  " + progress_line(run), flush=True)
            if run["status"] in TERMINAL or (until and until(run)):
                return run
            time.sleep(every)


def main() -> int:
    demo = Demo()
    say("1. start the service: embedded SQLite, the `local` host")
    demo.start_server()
    try:
        print(json.dumps(demo.call("GET", "/v1/hosts"), indent=1)[:400])
        spec = {"name": "demo-toy", "host": "local", "nproc_per_node": 2,
                "entrypoint": str(ROOT / "examples" / "toy_train.py"),
                "args": ["--steps", "150", "--sleep", "0.05", "--label", "first"]}
        say("2. submit a 2-process torchrun job: POST /v1/runs")
        run = demo.call("POST", "/v1/runs", json=spec)
        print(f"  run {run['id']} {run['status']}")
        say("3. watch it live (loss, step rate, ETA)")
        demo.watch(run["id"], until=lambda r: (r["latest"].get("step") or 0) >= 60)
        change = {"args": ["--steps", "100", "--sleep", "0.08", "--label", "second"]}
        say(f"4. what would a restart with {change} take? POST /v1/runs/{{id}}/restart?dry_run=true")
        dry = demo.call("POST", f"/v1/runs/{run['id']}/restart", params={"dry_run": "true"},
                        json={"overrides": change})
        print(f"  predicted {dry['predicted_duration_seconds']:.1f}s; basis: {dry['basis']}")
        say("5. restart it: stop every process of attempt 1, verify, relaunch as attempt 2")
        demo.call("POST", f"/v1/runs/{run['id']}/restart", json={"overrides": change})
        final = demo.watch(run["id"])
        say("6. result")
        for a in final["attempts"]:
            print(f"  attempt {a['number']}: {a['status']}, exit {a['exit_code']}, log {a['log_path']}")
        second = final["attempts"][-1]
        if second["actual_duration_seconds"] and second["predicted_duration_seconds"]:
            print(f"  attempt 2 took {second['actual_duration_seconds']:.1f}s; the dry run predicted "
                  f"{second['predicted_duration_seconds']:.1f}s (error {second['prediction_error'] * 100:+.0f}%)")
        loss = demo.call("GET", f"/v1/runs/{run['id']}/metrics", params={"names": "loss", "attempt": 2})
        print(f"  attempt 2 stored {len(loss['series']['loss'])} loss points")
        return 0 if final["status"] == "succeeded" else 1
    finally:
        demo.stop_server()


if __name__ == "__main__":
    sys.exit(main())
