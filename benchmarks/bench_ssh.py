"""SSH actions (issue 3): restart and cancel over loopback SSH, timed and counted in SSH round trips,
against the same actions done by hand with plain `ssh` commands.

    python benchmarks/bench_ssh.py [--repeat 5] [--poll 0.2]

Starts a real OpenSSH server on 127.0.0.1 (tests/sshd.py) and a real `longrun serve` (tests/service.py,
worker poll interval 0.2 s) with that server registered as host `box`. The job is examples/toy_train.py
under torchrun, 2 processes, which exits at once on SIGTERM, so the cancel grace period never comes into
play. Measured, each `--repeat` times:

- longrun restart: POST /restart → attempt 2 `running` (its processes started), and → its first metric
  stored; longrun cancel: POST /cancel → `cancelled` (the worker verified that no process is left).
- by hand, as a user would script it, one `ssh` command per step: `kill -TERM -- -$(cat pid)` (the job's
  process group), poll `pgrep -f` for the job until it is gone, start the new job with
  `setsid nohup torchrun ... &`, poll until metrics.jsonl is non-empty; cancel is the first two.
  Polls sleep `--poll` seconds between commands (the worker's own poll interval). Twice: a new SSH
  connection per command (`ssh`), and over one multiplexed connection (`ssh+cm`, ControlMaster).

Round trips are counted on the server side: sshd runs every command through a ForceCommand wrapper that
appends a timestamp and the command line to a log before exec'ing it, so every command executed over any
connection (longrun's persistent paramiko connection or a plain `ssh`) is one line, whoever sent it. A
restart's round trips are the commands from the request to the launch of the new attempt, leaving out the
worker's regular probes of the old attempt that began before the cancel (they belong to watching the run);
"→ first metric" adds the probes of the new attempt until its first metric arrived.

One JSON line per measurement, then one per (who, action) with medians.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads must not starve the other processes

from tests.service import TOY, Service  # noqa: E402
from tests.sshd import SshServer  # noqa: E402

VERB = re.compile(r"hostside-[0-9a-f]+ (\w+) '(.*)'$")


class LoggingSshServer(SshServer):
    """SshServer whose every command runs through a wrapper that logs it (time and command line)."""

    @property
    def command_log(self) -> Path:
        return self.dir / "commands.log"

    def _configure(self) -> None:
        super()._configure()
        wrapper = self.dir / "logcmd"
        wrapper.write_text(f"""#!/bin/bash
printf '%s %s\\n' "$EPOCHREALTIME" "${{SSH_ORIGINAL_COMMAND//$'\\n'/ }}" >> {shlex.quote(str(self.command_log))}
exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"
""")
        wrapper.chmod(0o755)
        with open(self.dir / "sshd_config", "a") as f:
            f.write(f"ForceCommand {wrapper}\n")

    def commands(self, since: float, until: float = float("inf")) -> list[dict[str, Any]]:
        """Commands that began in [since, until]: time, verb (longrun's) or "ssh", and the attempt dir."""
        out = []
        for line in self.command_log.read_text().splitlines():
            stamp, _, command = line.partition(" ")
            t = float(stamp)
            if not since <= t <= until:
                continue
            m = VERB.search(command)
            verb, directory = "ssh", None
            if m:
                verb = m.group(1)
                d = re.search(r'"dir": "([^"]+)"', m.group(2))
                directory = d.group(1) if d else None
            out.append({"t": t, "verb": verb, "dir": directory, "command": command})
        return out


def processes_under(workspace: Path) -> list[int]:
    """Live processes of any job under this workspace (longrun's and ours carry LONGRUN_ATTEMPT_DIR)."""
    prefix = f"LONGRUN_ATTEMPT_DIR={workspace}/".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                if any(v.startswith(prefix) for v in f.read().split(b"\0")):
                    found.append(int(entry))
    return found


def kill_all(workspace: Path) -> None:
    for pid in processes_under(workspace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(what: str, cond: Any, timeout: float = 120, every: float = 0.02) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")


def job_args(label: str) -> list[str]:
    return ["--steps", "100000", "--sleep", "0.05", "--label", label]


# longrun


def bench_longrun(svc: Service, sshd: LoggingSshServer, workspace: Path, rep: int, nproc: int) -> list[dict[str, Any]]:
    spec = {"name": f"bench-{rep}", "host": "box", "nproc_per_node": nproc, "entrypoint": TOY,
            "args": job_args(f"lr-{rep}-1")}
    run = svc.submit(spec)
    rid = run["id"]
    wait_for("attempt 1's first metric", lambda: "step" in svc.run(rid)["latest"])
    time.sleep(1.0)
    old_dir = svc.run(rid)["attempts"][0]["nodes"][0]["dir"]

    t0 = time.time()
    r = svc.client.post(f"/v1/runs/{rid}/restart", json={"overrides": {"args": job_args(f"lr-{rep}-2")}})
    assert r.status_code == 202, r.text
    wait_for("attempt 2 running", lambda: (x := svc.run(rid))["attempt"] == 2 and x["status"] == "running")
    t_running = time.time()
    wait_for("attempt 2's first metric", lambda: "step" in svc.run(rid)["latest"])
    t_metric = time.time()
    cmds = sshd.commands(t0, t_metric)
    cancel_t = min((c["t"] for c in cmds if c["verb"] == "cancel"), default=t0)
    # regular probes of attempt 1 that began before the cancel belong to watching the run, not to the restart
    cmds = [c for c in cmds if not (c["verb"] == "probe" and c["dir"] == old_dir and c["t"] < cancel_t)]
    launch_t = max(c["t"] for c in cmds if c["verb"] == "launch")
    to_launch = [c for c in cmds if c["t"] <= launch_t]
    restart = {"bench": "ssh", "who": "longrun", "action": "restart", "rep": rep,
               "seconds_to_running": round(t_running - t0, 3), "seconds_to_first_metric": round(t_metric - t0, 3),
               "round_trips_to_running": len(to_launch), "round_trips_to_first_metric": len(cmds),
               "verbs_to_running": [c["verb"] for c in to_launch]}
    print(json.dumps(restart), flush=True)

    time.sleep(1.0)
    t0 = time.time()
    r = svc.client.post(f"/v1/runs/{rid}/cancel")
    assert r.status_code == 202, r.text
    done = wait_for("cancelled", lambda: (x := svc.run(rid))["status"] in ("cancelled", "failed") and x)
    t_done = time.time()
    assert done["status"] == "cancelled", done
    left = processes_under(workspace / ".longrun" / rid)
    assert not left, f"processes of the run left after cancel: {left}"
    cmds = sshd.commands(t0, t_done)
    cancel_t = min(c["t"] for c in cmds if c["verb"] == "cancel")
    cmds = [c for c in cmds if not (c["verb"] == "probe" and c["t"] < cancel_t)]
    cancel = {"bench": "ssh", "who": "longrun", "action": "cancel", "rep": rep,
              "seconds_to_gone": round(t_done - t0, 3), "round_trips": len(cmds), "verbs": [c["verb"] for c in cmds]}
    print(json.dumps(cancel), flush=True)
    return [restart, cancel]


# by hand


class Hand:
    """What a user types: `ssh -i key -p port -o UserKnownHostsFile=... host CMD`, one command per step."""

    def __init__(self, sshd: LoggingSshServer, tmp: Path, workspace: Path, poll: float, nproc: int,
                 multiplex: bool):
        known = tmp / "known_hosts"
        known.write_text(sshd.known_hosts_line + "\n")
        self.base = ["ssh", "-i", sshd.client_key_path, "-p", str(sshd.port), "-o", f"UserKnownHostsFile={known}",
                     "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
        if multiplex:
            self.base += ["-o", "ControlMaster=auto", "-o", f"ControlPath={tmp}/cm-%C", "-o", "ControlPersist=120"]
        self.target = f"{sshd.username}@{sshd.address}"
        self.sshd, self.workspace, self.poll, self.nproc = sshd, workspace, poll, nproc
        self.who, self.tag = ("ssh+cm", "sshcm") if multiplex else ("ssh", "ssh")

    def ssh(self, command: str) -> int:
        return subprocess.run(self.base + [self.target, command], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode

    def close(self) -> None:
        subprocess.run(self.base + ["-O", "exit", self.target], capture_output=True)

    def launch(self, d: str, label: str) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}",
                TOY, *job_args(label)]
        env = (f"LONGRUN_METRICS_FILE={d}/metrics.jsonl LONGRUN_ATTEMPT_DIR={d} OMP_WAIT_POLICY=PASSIVE")
        assert self.ssh(f"mkdir -p {d} && cd {d} && {{ {env} setsid nohup {shlex.join(argv)} "
                        f"> out.log 2>&1 < /dev/null & echo $! > pid; }}") == 0, f"could not launch in {d}"

    def poll_until(self, command: str, what: str, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while self.ssh(command) != 0:
            if time.time() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(self.poll)

    def wait_metric(self, d: str) -> None:
        self.poll_until(f"test -s {d}/metrics.jsonl", f"a metric in {d}")

    def stop(self, d: str, label: str) -> None:
        assert self.ssh(f"kill -TERM -$(cat {d}/pid)") == 0, f"could not signal the job in {d}"
        # torchrun's workers run in sessions of their own: look for every process of the job, not the group;
        # the bracket keeps pgrep from matching the shell that runs it
        pattern = shlex.quote(f"label [{label[0]}]{label[1:]}$")
        self.poll_until(f"! pgrep -f {pattern} > /dev/null", f"the job in {d} gone")

    def bench(self, rep: int) -> list[dict[str, Any]]:
        d1, d2 = (f"{self.workspace}/hand-{self.tag}/{rep}/{k}" for k in (1, 2))
        l1, l2 = f"hand-{self.tag}-{rep}-1", f"hand-{self.tag}-{rep}-2"
        self.launch(d1, l1)
        self.wait_metric(d1)
        time.sleep(1.0)

        t0 = time.time()
        self.stop(d1, l1)
        self.launch(d2, l2)
        t_running = time.time()
        self.wait_metric(d2)
        t_metric = time.time()
        to_running = len(self.sshd.commands(t0, t_running))
        restart = {"bench": "ssh", "who": self.who, "action": "restart", "rep": rep,
                   "seconds_to_running": round(t_running - t0, 3), "seconds_to_first_metric": round(t_metric - t0, 3),
                   "round_trips_to_running": to_running,
                   "round_trips_to_first_metric": len(self.sshd.commands(t0, t_metric))}
        print(json.dumps(restart), flush=True)

        time.sleep(1.0)
        t0 = time.time()
        self.stop(d2, l2)
        t_done = time.time()
        assert not processes_under(self.workspace), "the hand-made cancel left processes"
        cancel = {"bench": "ssh", "who": self.who, "action": "cancel", "rep": rep,
                  "seconds_to_gone": round(t_done - t0, 3), "round_trips": len(self.sshd.commands(t0, t_done))}
        print(json.dumps(cancel), flush=True)
        return [restart, cancel]


def summarise(rows: list[dict[str, Any]]) -> None:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["who"], row["action"]), []).append(row)
    for (who, action), rs in groups.items():
        out: dict[str, Any] = {"bench": "ssh-median", "who": who, "action": action, "n": len(rs)}
        for key in rs[0]:
            if key.startswith(("seconds", "round_trips")):
                out[key] = round(statistics.median(r[key] for r in rs), 3)
        print(json.dumps(out), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--poll", type=float, default=0.2, help="seconds between the hand-made polls")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--skip-hand", action="store_true")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still cleans up (finally below)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="longrun-bench-ssh-") as tmp_name, LoggingSshServer() as sshd:
        tmp = Path(tmp_name)
        workspace = tmp / "ws"
        workspace.mkdir()
        svc = Service(tmp / "home", ssh_connect_timeout=5, ssh_command_timeout=30)
        svc.home.mkdir()
        hands: list[Hand] = []
        try:
            svc.start()
            body = {"name": "box", **sshd.host_fields, "workspace": str(workspace), "python": sys.executable}
            r = svc.client.post("/v1/hosts", json=body)
            assert r.status_code == 201, r.text
            if not args.skip_hand:
                hands = [Hand(sshd, tmp, workspace, args.poll, args.nproc, multiplex=m) for m in (False, True)]
            for rep in range(1, args.repeat + 1):
                rows += bench_longrun(svc, sshd, workspace, rep, args.nproc)
                for hand in hands:
                    rows += hand.bench(rep)
        finally:
            svc.stop()
            for hand in hands:
                hand.close()
            kill_all(workspace)
    summarise(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
