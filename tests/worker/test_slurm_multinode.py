"""A run over two Slurm nodes: a cluster whose two slurmd run in network namespaces of their own (separate
addresses on a private bridge, tests/netns.py), the controller and the login node on this machine. torchrun
starts on each node through srun and meets at the c10d rendezvous of the first."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import PrivateNetwork
from tests.service import Service, attempt_processes, toy_spec
from tests.slurm import SlurmCluster, job_of, serving

pytestmark = pytest.mark.slow  # two slurmd in namespaces, a real server and torchrun


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[SlurmCluster, Service]]:
    with (PrivateNetwork() as net, net.namespace() as a, net.namespace() as b, SlurmCluster([a, b]) as cluster,
          serving(cluster, tmp_path) as svc):
        yield cluster, svc


def test_a_two_node_run_meets_at_the_first_node_and_a_cancel_leaves_nothing_on_either(
        two_nodes: tuple[SlurmCluster, Service]) -> None:
    cluster, service = two_nodes
    spec = {**toy_spec(steps=2000, sleep=0.05, nproc=1), "host": "cluster", "slurm": {"nodes": 2}}
    run = service.submit(spec)
    # each step all-reduces across the two nodes: steps that advance mean the rendezvous and gloo both reach across
    running = service.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 5, timeout=120,
                           what="both nodes training")
    assert any("world size 2" in line for line in service.logs(run["id"], tail=100)), "one rank on each node"
    job = job_of(running, 1)
    assert "NodeList=n[1-2]" in cluster.command("scontrol", "show", "job", job)
    assert len(attempt_processes(running, 1)) >= 4, "torchrun and its worker on each of the two nodes"
    assert service.client.post(f"/v1/runs/{run['id']}/cancel").status_code == 202
    cancelled = service.wait_status(run["id"], "cancelled", "failed", timeout=60)
    assert cancelled["status"] == "cancelled", cancelled
    assert attempt_processes(cancelled, 1) == [] and cluster.active_jobs() == {}
    assert cluster.jobs()[job] == "CANCELLED"
    steps = [p["step"] for p in service.series(run["id"], "loss")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5, "each metric line stored once"
