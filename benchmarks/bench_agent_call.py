"""The host agent's cost per call: CPU seconds of one `probe`, the call the worker makes every few seconds for every
running attempt, installed as longrun installs it (unpacked, its bytecode cached beside it) against the same agent
run as the zipapp it travels as (every module compiled again on each call).

    python benchmarks/bench_agent_call.py [--calls 200] [--python python3]

Both through the real command HostAgent sends over the `local` transport (`if [ -f …/__main__.py ]; then exec python
-S -X utf8 AGENT probe; …`), the request on stdin, in a fresh workspace. CPU is the children's user + system time
(os.times), so the shell and the python it execs are counted and this process is not. Calls alternate between the
two, so a busy machine weighs on both alike. One JSON line.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.host_agent import AGENT_FLAGS, HOSTSIDE_ZIPAPP, HostAgent  # noqa: E402
from worker.local_transport import LocalTransport  # noqa: E402
from worker.protocol import ReadFrom  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="probes of each kind")
    p.add_argument("--python", default=sys.executable, help="the host's python")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as workspace:
        agent = HostAgent(LocalTransport(), workspace, args.python)
        attempt = agent.layout.attempt_dir("r1", 1)
        agent.probe(attempt, ReadFrom())  # installs it, and caches its bytecode
        zipapp = Path(workspace) / "hostside.pyz"
        zipapp.write_bytes(HOSTSIDE_ZIPAPP)
        request = json.dumps({"dir": attempt}).encode() + b"\n"
        zipped = shlex.join([args.python, *AGENT_FLAGS, str(zipapp), "probe"])
        cpu = {"installed": 0.0, "zipapp": 0.0}
        wall = {"installed": 0.0, "zipapp": 0.0}
        for _ in range(args.calls):
            for kind in cpu:
                before, start = os.times(), time.perf_counter()
                if kind == "installed":
                    assert agent.probe(attempt, ReadFrom()).state == "missing"
                else:
                    done = subprocess.run(["/bin/sh", "-c", f"exec {zipped}"], input=request, capture_output=True,
                                          check=True)
                    assert json.loads(done.stdout)["state"] == "missing", done.stderr
                after = os.times()
                wall[kind] += time.perf_counter() - start
                cpu[kind] += (after.children_user - before.children_user) + (after.children_system - before.children_system)
    per_call = {kind: round(1000 * cpu[kind] / args.calls, 1) for kind in cpu}
    print(json.dumps({
        "calls": args.calls, "python": args.python, "cpu_ms_per_probe": per_call,
        "wall_ms_per_probe": {kind: round(1000 * wall[kind] / args.calls, 1) for kind in wall},
        "installed_over_zipapp_cpu": round(per_call["installed"] / per_call["zipapp"], 3),
    }))


if __name__ == "__main__":
    main()
