"""A real single-node Slurm cluster for tests, from Debian's slurm-wlm and munge: its own munge key and daemon,
slurm.conf, state directories and ports, so it touches no system configuration.

    with SlurmCluster() as cluster:          # slurmctld and slurmd up, the node idle
    with SlurmCluster([ns1, ns2]) as c:      # two nodes n1, n2: a slurmd in each tests.netns.NetNamespace
        cluster.env                          # SLURM_CONF: what sbatch, squeue, scontrol need to find it
        cluster.command("squeue")            # a Slurm command against it
        cluster.wait_state(job, "RUNNING")   # wait until the controller says the job is in that state
        cluster.cancel_all()                 # scancel every job and wait until none is left

The node is this machine (NodeName = its short hostname, address 127.0.0.1) with its CPUs (nproc); jobs are
tracked by proctrack/linuxproc. With network namespaces (of one tests.netns.PrivateNetwork) each is a node of its
own, n1, n2, ..., at the namespace's address, its slurmd entered into the namespace with nsenter (`ip netns exec`
would mount a /sys without the cgroup file systems slurmd needs); slurmctld listens on the network's gateway. Accounting needs slurmdbd (and a MySQL server), which the tests do not run:
`sacct` answers "Slurm accounting storage is disabled", so finished jobs are read from the controller, which keeps
them for MinJobAge seconds (the host agent asks the controller first and sacct only after).
slurmd runs jobs as their submitting user only as root: without root the fixture fails saying so.
KillWait (SIGTERM to SIGKILL) is Slurm's default 30 s: the trainer stopping at a step takes several seconds to exit
on a loaded 2-core machine, and a SIGKILL must mean that it did not stop.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.resource import Resource
from tests.service import Service, kill_leftovers
from tests.sshd import apt_install, free_port

INSTALL_HINT = "install Slurm and munge (apt-get install slurm-wlm munge, or `make system-deps` as root)"
DAEMONS = ("munged", "slurmctld", "slurmd")


def ensure_slurm_installed() -> None:
    """Install slurm-wlm and munge when missing and we are root; fail clearly otherwise."""
    if not all(shutil.which(d) or os.path.exists(f"/usr/sbin/{d}") for d in DAEMONS):
        apt_install(["slurm-wlm", "munge"], INSTALL_HINT)


class SlurmCluster(Resource):
    def __init__(self, namespaces: list[Any] | None = None) -> None:
        self.dir: Path | None = None
        self.cpus = os.cpu_count() or 1
        self.namespaces = namespaces or []
        # node name -> (address, network namespace name or None)
        self.nodes = ({f"n{i + 1}": (ns.address, ns.name) for i, ns in enumerate(self.namespaces)} or
                      {socket.gethostname().split(".")[0]: ("127.0.0.1", None)})
        self.controller = self.namespaces[0].gateway if self.namespaces else "127.0.0.1"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.dir / "slurm.conf")}

    def _prepare(self) -> None:
        ensure_slurm_installed()
        if os.geteuid() != 0:
            pytest.fail("slurmd runs jobs as their user only as root: run the Slurm tests as root", pytrace=False)
        self.dir = Path(tempfile.mkdtemp(prefix="longrun-slurm-"))

    def _open(self) -> None:
        self._configure()
        self._start()

    def _configure(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir(mode=0o700)
        # munged refuses a socket directory others cannot enter
        (d / "munge").chmod(0o755)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (d / "slurm.conf").write_text(f"""\
ClusterName=longruntest
SlurmctldHost={socket.gethostname().split(".")[0]}({self.controller})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / 'munge' / 'socket'}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log'}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
MinJobAge=600
KillWait=30
InactiveLimit=0
SlurmdParameters=config_overrides
""" + "".join(f"NodeName={name} NodeAddr={address} CPUs={self.cpus} State=UNKNOWN\n"
              for name, (address, _) in self.nodes.items())
            + f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP\n")
        for name in self.nodes:
            (d / "spool" / name).mkdir()

    def _start(self) -> None:
        d = self.dir
        subprocess.run(["munged", "--force", f"--key-file={d / 'munge.key'}", f"--socket={d / 'munge' / 'socket'}",
                        f"--pid-file={d / 'munge' / 'munged.pid'}", f"--seed-file={d / 'munge' / 'seed'}",
                        f"--log-file={d / 'log' / 'munged.log'}"], check=True, capture_output=True)
        env = {**os.environ, **self.env}
        daemons = [("slurmctld", ["slurmctld", "-i"])]
        for name, (_, netns) in self.nodes.items():
            enter = ["nsenter", f"--net=/var/run/netns/{netns}"] if netns else []
            daemons.append((f"slurmd-{name}", [*enter, "slurmd", "-N", name]))
        for log, argv in daemons:
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{log} did not start: {done.stderr.strip()}\n{self.log_tail(log)}")
        self.wait_idle()

    def wait_idle(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.command("sinfo", "--noheader", "--format=%t", check=False).strip()
            if state == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm nodes are {state!r}, not idle, after {timeout}s:\n"
                           + "\n".join(self.log_tail(log) for log in ["slurmctld", *(f"slurmd-{n}" for n in self.nodes)]))

    def command(self, *argv: str, check: bool = True) -> str:
        """A Slurm command against this cluster, run in its directory (where a job without --output writes)."""
        done = subprocess.run(argv, env={**os.environ, **self.env}, cwd=self.dir, capture_output=True, text=True,
                              timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def jobs(self) -> dict[str, str]:
        """Job id -> state of every job the controller still holds, ended ones included."""
        out = self.command("squeue", "--noheader", "--states=all", "--format=%i %T")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def active_jobs(self) -> dict[str, str]:
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
                 "OUT_OF_MEMORY"}
        return {job: state for job, state in self.jobs().items() if state not in ended}

    def wait_state(self, job: str, state: str, timeout: float = 30) -> None:
        """Wait until the controller says `job` is in `state` (a job submitted to a free node may not start at once)."""
        deadline = time.monotonic() + timeout
        while self.jobs().get(job) != state:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} is {self.jobs().get(job)}, not {state}, after {timeout}s")
            time.sleep(0.2)

    def cancel_all(self, timeout: float = 30) -> None:
        """scancel every job of the cluster and wait until none runs (slurmstepd reaps its processes)."""
        if self.dir is None or not (self.dir / "slurmctld.pid").exists():
            return
        for job in self.active_jobs():
            self.command("scancel", job, check=False)
        deadline = time.monotonic() + timeout
        while self.active_jobs() and time.monotonic() < deadline:
            time.sleep(0.2)

    def log_tail(self, daemon: str, chars: int = 2000) -> str:
        try:
            return (self.dir / "log" / f"{daemon}.log").read_text()[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.dir is None:
            return
        try:
            self.cancel_all()
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        for pid_file in [*(f"slurmd-{n}.pid" for n in self.nodes), "slurmctld.pid", "munge/munged.pid"]:
            self._stop_daemon(self.dir / pid_file)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    @staticmethod
    def _stop_daemon(pid_file: Path, timeout: float = 10) -> None:
        try:
            pid = int(pid_file.read_text().strip())
            os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def job_of(run: dict[str, Any], number: int) -> str:
    """The Slurm job id of a run's attempt (as the API shows the run): its node's pid."""
    return str(run["attempts"][number - 1]["nodes"][0]["pid"])


@contextmanager
def serving(cluster: SlurmCluster, directory: Path) -> Iterator[Service]:
    """A started server whose host `cluster` (kind slurm, address `local`) is a login node of `cluster`, with its
    workspace under `directory`; after, its jobs cancelled and its processes gone."""
    svc = Service(directory / "home")
    svc.env.update(cluster.env)
    svc.home.mkdir()
    svc.start()
    workspace = directory / "shared"
    try:
        r = svc.client.post("/v1/hosts", json={"name": "cluster", "kind": "slurm", "address": "local",
                                                "workspace": str(workspace), "python": sys.executable})
        assert r.status_code == 201, r.text
        yield svc
    finally:
        cluster.cancel_all()
        svc.stop()
        kill_leftovers(workspace)
