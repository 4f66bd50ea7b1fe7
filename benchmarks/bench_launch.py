"""The host agent's launch on this machine: how long the `launch` call takes, and whether a cancel sent the moment
it answers stops the job on request (issue 18).

    python benchmarks/bench_launch.py [--repeat 10] [--root TREE]

Runs the host agent (worker/hostside/, shipped as its zipapp) for real over `LocalTransport` (the `local` host's transport), as the worker does, with
the containment layer this machine offers. Each round launches a job that exits 0 on SIGTERM, times the launch
call, then cancels it at once (grace 3 s) and records how long the cancel took and the attempt's exit code: 0 or
143 is a stop on request, 137 a job that was left running until the grace period's SIGKILL. `--root` imports the
agent from another checkout (`git worktree add /tmp/old REV`), for an A/B in one command line each.

One JSON line per round, then the medians.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

JOB = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(600)\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.root.resolve()))
    from worker.host_agent import HostAgent
    from worker.local_transport import LocalTransport
    from worker.protocol import LaunchRequest

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        agent = HostAgent(LocalTransport(), f"{tmp}/ws", sys.executable)
        for i in range(args.repeat + 1):  # the first round installs the agent: not counted
            d = agent.layout.attempt_dir(f"bench{i}", 1)
            t = time.perf_counter()
            agent.launch(LaunchRequest(d, f"tok-bench-{i}", [sys.executable, "-c", JOB], {}))
            launched = time.perf_counter()
            answer = agent.cancel(d, grace=3)
            done = dict(launch_ms=round((launched - t) * 1000, 1), cancel_s=round(time.perf_counter() - launched, 3),
                        exit_code=answer.exit_code, left=answer.remaining)
            if i:
                rounds.append(done)
                print(json.dumps(done), flush=True)
    print(json.dumps(dict(
        root=str(args.root), rounds=len(rounds),
        launch_ms_median=round(statistics.median(r["launch_ms"] for r in rounds), 1),
        cancel_s_median=round(statistics.median(r["cancel_s"] for r in rounds), 3),
        killed_at_grace=sum(r["exit_code"] == 137 for r in rounds),
        left_running=sum(bool(r["left"]) for r in rounds))))


if __name__ == "__main__":
    main()
