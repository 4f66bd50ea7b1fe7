"""Reading a host's interconnect: nvidia-smi topo -m and the all-reduce sweep's answer (untrusted input), and
the hostside `interconnect` verb run for real on this machine: the shipped sweep script installed and run with
this Python (torch, no GPU), or a host's LONGRUN_ALLREDUCE_SWEEP stand-in (tests/fakegpu)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.layout import HostLayout
from worker.host_agent import HostAgent
from worker.interconnect import SWEEP_NAME, SWEEP_SOURCE, ProbeFailed, measurement, parse_topology, read_sweep
from worker.local_transport import LocalTransport
from worker.protocol import CommandOutput, InterconnectRequest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "h200x2"
FAKEGPU = ROOT / "tests" / "fakegpu"
TOPO = (FIXTURES / "topo-m.txt").read_text()
NVLINK = json.loads((FIXTURES / "allreduce-nvlink.json").read_text())

# an 8-GPU PCIe box (two NUMA nodes, a NIC column), as nvidia-smi prints it
PCIE_TOPO = """\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tNODE\tSYS\tPHB\t0-15\t0
GPU1\tPIX\t X \tNODE\tSYS\tPHB\t0-15\t0
GPU2\tNODE\tNODE\t X \tSYS\tSYS\t16-31\t1
GPU3\tSYS\tSYS\tSYS\t X \tSYS\t16-31\t1
NIC0\tPHB\tPHB\tSYS\tSYS\t X

Legend:
  X    = Self
"""


def sweep_output(answer: object, rc: int = 0, stderr: str = "") -> CommandOutput:
    text = answer if isinstance(answer, str) else json.dumps(answer)
    return CommandOutput(rc, text + "\n", stderr)


def test_the_captured_h200_topology_is_two_gpus_over_nvlink_despite_its_ansi_codes() -> None:
    assert "\x1b[4m" in TOPO
    topology = parse_topology(TOPO)
    assert topology == {"gpus": 2, "links": [{"a": 0, "b": 1, "path": "NV18"}], "interconnect": "nvlink",
                        "note": None}


def test_a_pcie_box_reads_as_pcie_with_every_pair_and_without_the_nic() -> None:
    topology = parse_topology(PCIE_TOPO)
    assert topology["gpus"] == 4 and topology["interconnect"] == "pcie"
    assert {(link["a"], link["b"]): link["path"] for link in topology["links"]} == {
        (0, 1): "PIX", (0, 2): "NODE", (0, 3): "SYS", (1, 2): "NODE", (1, 3): "SYS", (2, 3): "SYS"}


@pytest.mark.parametrize("garbage", [
    "", "No devices were found\n", "\x00\xff" * 500, "GPU0\n" * 3, "GPU0 GPU1\nGPU0 X banana\nGPU1 ??? X\n",
    "GPU0\tGPU1\nGPU0\t X \t" + "Z" * 100000,
])
def test_garbage_topology_gives_no_links_and_says_so_rather_than_failing(garbage: str) -> None:
    topology = parse_topology(garbage)
    assert topology["interconnect"] is None and topology["links"] == []
    assert topology["note"]


def test_the_sweep_table_is_read_sorted_and_checked() -> None:
    answer = {"world": 2, "gpus": ["NVIDIA H200"] * 2, "gpu_count": 2, "allreduce": NVLINK["allreduce"][::-1],
              "nccl_env": {}}
    table = read_sweep(sweep_output(answer), 2)
    assert table["tp"] == 2 and table["gpu_count"] == 2
    assert table["allreduce"] == [{"bytes": r["bytes"], "us": r["us"]} for r in NVLINK["allreduce"]]


@pytest.mark.parametrize(("stdout", "says"), [
    ("Traceback (most recent call last):\n  ImportError: no torch", "did not answer JSON"),
    ('["a list"]', "did not answer JSON"),
    (json.dumps({"error": "this host has 1 GPU(s); measuring all-reduce at tp=2 needs 2", "gpu_count": 1}),
     "this host has 1 GPU"),
    (json.dumps({"world": 4, "allreduce": NVLINK["allreduce"]}), "measured 4 ranks, not the tp=2"),
    (json.dumps({"world": True, "allreduce": NVLINK["allreduce"]}), "no valid world size"),
    (json.dumps({"world": 2, "allreduce": []}), "no table"),
    (json.dumps({"world": 2, "allreduce": [{"bytes": 1024, "us": -1}]}), "no valid time"),
    (json.dumps({"world": 2, "allreduce": [{"bytes": 1024, "us": float("nan")}]}), "no valid time"),
    (json.dumps({"world": 2, "allreduce": [{"bytes": "1k", "us": 3}]}), "no valid message size"),
    (json.dumps({"world": 2, "allreduce": [[1024, 3.0]]}), "no valid message size"),
    (json.dumps({"world": 2, "allreduce": [{"bytes": 1 << k, "us": 1.0} for k in range(300)]}), "no table"),
])
def test_a_sweep_answer_that_is_not_a_measurement_fails_the_probe_with_the_reason(stdout: str, says: str) -> None:
    with pytest.raises(ProbeFailed, match=says):
        read_sweep(CommandOutput(1, stdout, ""), 2)


def test_nccl_p2p_disabled_counts_as_pcie_whatever_the_links_and_a_failed_topo_is_noted() -> None:
    answer = {"world": 2, "allreduce": NVLINK["allreduce"], "nccl_env": {"NCCL_P2P_DISABLE": "1"}}
    assert measurement(CommandOutput(0, TOPO, ""), sweep_output(answer), 2)["interconnect"] == "pcie"
    failed_topo = measurement(CommandOutput(127, "", "nvidia-smi: not found"), sweep_output({**answer, "nccl_env": {}}), 2)
    assert failed_topo["interconnect"] is None and "not found" in failed_topo["topology"]["note"]


def test_only_the_links_of_the_measured_gpus_decide_the_interconnect() -> None:
    # GPUs 0 and 1 share a PCIe switch; a probe at tp=2 measured them, not the SYS links to 2 and 3
    answer = {"world": 2, "allreduce": NVLINK["allreduce"]}
    nvlinked = PCIE_TOPO.replace("GPU0\t X \tPIX", "GPU0\t X \tNV4").replace("GPU1\tPIX\t X", "GPU1\tNV4\t X")
    assert measurement(CommandOutput(0, nvlinked, ""), sweep_output(answer), 2)["interconnect"] == "nvlink"
    assert measurement(CommandOutput(0, PCIE_TOPO, ""), sweep_output(answer), 2)["interconnect"] == "pcie"


def probe_locally(tmp_path: Path, tp: int | str, env: dict[str, str]) -> CommandOutput:
    """The interconnect verb through a real HostAgent over the local transport, with `env` as the host's."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        agent = HostAgent(LocalTransport(), str(tmp_path), sys.executable, timeout=300)
        request = InterconnectRequest(tp=tp, sweep_path=f"{HostLayout(str(tmp_path)).bin_dir}/{SWEEP_NAME}",
                                      sweep_source=SWEEP_SOURCE, timeout=240)
        return agent.call(request)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow  # the sweep's python imports torch
def test_the_shipped_sweep_is_installed_and_run_on_the_host_and_says_it_found_no_gpu(tmp_path: Path) -> None:
    answer = probe_locally(tmp_path, 2, {"PATH": f"{FAKEGPU}:{os.environ['PATH']}"})
    installed = Path(HostLayout(str(tmp_path)).bin_dir) / SWEEP_NAME
    assert installed.read_text() == SWEEP_SOURCE
    assert parse_topology(answer.topo.stdout)["interconnect"] == "nvlink"
    # this machine's torch has no CUDA: the real sweep says so instead of measuring
    with pytest.raises(ProbeFailed, match="sees no CUDA GPU"):
        read_sweep(answer.sweep, 2)


def test_a_hosts_sweep_stand_in_answers_with_the_captured_h200_times(tmp_path: Path) -> None:
    env = {"PATH": f"{FAKEGPU}:{os.environ['PATH']}", "LONGRUN_ALLREDUCE_SWEEP": str(FAKEGPU / "allreduce-sweep")}
    answer = probe_locally(tmp_path, "all", env)
    measured = measurement(answer.topo, answer.sweep, "all")
    assert measured["tp"] == 2 and measured["interconnect"] == "nvlink"
    assert measured["allreduce"] == NVLINK["allreduce"]
    too_many = probe_locally(tmp_path, 4, env)
    with pytest.raises(ProbeFailed, match="this host has 2 GPU"):
        measurement(too_many.topo, too_many.sweep, 4)


@pytest.mark.slow  # the sweep's python imports torch
def test_the_sweep_script_stands_alone_and_refuses_bad_arguments() -> None:
    script = ROOT / "worker" / "allreduce_sweep.py"
    bad = subprocess.run([sys.executable, str(script), "--tp", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--tp" in bad.stderr
    no_gpu = subprocess.run([sys.executable, str(script), "--tp", "2", "--sizes", "1024"], capture_output=True,
                            text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert no_gpu.returncode == 3 and json.loads(no_gpu.stdout)["gpu_count"] == 0


def cuda_available() -> bool:
    import torch  # only where nvidia-smi is (the skipif below asks it second), not at every collection

    return torch.cuda.is_available()


@pytest.mark.skipif(shutil.which("nvidia-smi") is None or not cuda_available(),
                    reason="needs GPUs, nvidia-smi and CUDA torch")
def test_on_a_gpu_host_the_probe_measures_every_gpu_and_refuses_one_more(tmp_path: Path) -> None:
    import torch

    count = torch.cuda.device_count()
    answer = probe_locally(tmp_path, "all", {})
    measured = measurement(answer.topo, answer.sweep, "all")
    assert measured["tp"] == count and measured["gpu_count"] == count
    assert measured["topology"]["gpus"] == (count if count > 1 else 0)
    if count > 1:
        sizes = [row["bytes"] for row in measured["allreduce"]]
        assert sizes == sorted(sizes) and sizes[0] == 1024 and sizes[-1] == 64 << 20
        assert all(row["us"] > 0 for row in measured["allreduce"])
        # 64 MiB cannot go faster than 1 KiB: whatever the link, it is bandwidth-bound there
        assert measured["allreduce"][-1]["us"] > measured["allreduce"][0]["us"]
        assert measured["interconnect"] in ("nvlink", "pcie")
    too_many = probe_locally(tmp_path, count + 1, {})
    with pytest.raises(ProbeFailed, match=f"this host has {count} GPU"):
        measurement(too_many.topo, too_many.sweep, count + 1)
