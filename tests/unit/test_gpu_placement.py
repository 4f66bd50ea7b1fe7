"""GPU placement decisions over the captured H200 snapshots (tests/fixtures/h200x2)."""

from pathlib import Path

import pytest

from server.spec import RunCreate
from worker.gpu_placement import WaitForGpus, gpu_holders, gpu_readings, placement_env
from worker.protocol import GpusAnswer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "h200x2"


def _view(state: str, owners: dict[int, dict] | None = None):
    gpu = (FIXTURES / f"query-gpu-{state}.csv").read_text()
    apps = (FIXTURES / f"compute-apps-{state}.csv").read_text()
    return GpusAnswer.from_wire({"gpu": {"rc": 0, "stdout": gpu, "stderr": ""}, "apps": {"rc": 0, "stdout": apps, "stderr": ""},
                                 "owners": {str(k): v for k, v in (owners or {}).items()}}).view()


def _spec(**fields: object) -> RunCreate:
    return RunCreate.model_validate({"host": "box", "entrypoint": "/opt/train.py", **fields})


def test_an_idle_host_gives_a_one_gpu_run_the_first_gpu() -> None:
    env = placement_env(_spec(nproc_per_node=1, env={"X": "1"}), "tok", "box", _view("idle"))
    assert env == {"X": "1", "CUDA_VISIBLE_DEVICES": "0"}


def test_a_run_needing_every_gpu_waits_for_foreign_holders() -> None:
    busy = _view("busy", {568: {"user": "alice", "token": None}, 569: {"user": "bob", "token": None}})
    with pytest.raises(WaitForGpus, match="GPU 0 is held by pid 568 .*user alice"):
        placement_env(_spec(nproc_per_node=2), "tok", "box", busy)


def test_our_own_processes_do_not_block_us_and_are_what_we_report() -> None:
    ours = _view("busy", {568: {"user": "me", "token": "tok"}, 569: {"user": "me", "token": "tok"}})
    assert "CUDA_VISIBLE_DEVICES" not in placement_env(_spec(nproc_per_node=2), "tok", "box", ours)
    assert gpu_readings(ours, "tok", None) == {"gpu_util_0": 100.0, "gpu_mem_0": 20085.0,
                                               "gpu_util_1": 100.0, "gpu_mem_1": 20085.0}
    assert gpu_holders(ours, "tok", set()) == [568, 569]


def test_readings_before_the_job_holds_a_gpu_use_the_assigned_ones() -> None:
    assert set(gpu_readings(_view("idle"), "tok", [1], node_index=2)) == {"node2_gpu_util_1", "node2_gpu_mem_1"}
