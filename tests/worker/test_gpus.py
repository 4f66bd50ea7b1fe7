import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from worker.gpus import (
    QUERY_APPS_CMD,
    QUERY_GPU_CMD,
    Gpu,
    GpuProcess,
    GpuSnapshot,
    attach_users,
    foreign_gpu_holders,
    holders_message,
    parse_gpus,
    pick_free_gpus,
    snapshot_from_outputs,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200x2"
UUID0 = "GPU-deed2697-20f2-b946-4252-f91700b71749"
UUID1 = "GPU-c5b8aa63-a3fc-e6dc-7862-126bebb50009"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def snapshot(kind: str) -> GpuSnapshot:
    return snapshot_from_outputs(0, fixture(f"query-gpu-{kind}.csv"), fixture(f"compute-apps-{kind}.csv"), "")


def test_commands_are_the_ones_the_fixtures_were_captured_with():
    readme = fixture("README.md")
    assert " ".join(QUERY_GPU_CMD) in readme
    assert " ".join(QUERY_APPS_CMD) in readme


def test_idle_fixture():
    snap = snapshot("idle")
    assert snap.available and snap.message is None
    assert [g.index for g in snap.gpus] == [0, 1]
    assert [g.uuid for g in snap.gpus] == [UUID0, UUID1]
    for gpu in snap.gpus:
        assert gpu.name == "NVIDIA H200"
        assert (gpu.utilization_pct, gpu.memory_used_mib, gpu.memory_total_mib) == (0, 0, 143771)
        assert gpu.processes == []
    assert pick_free_gpus(snap, 2, set()) == [0, 1]
    assert foreign_gpu_holders(snap, set(), None) == []


def test_busy_fixture():
    snap = snapshot("busy")
    assert snap.available
    assert [(g.index, g.uuid) for g in snap.gpus] == [(0, UUID0), (1, UUID1)]
    for gpu in snap.gpus:
        assert (gpu.utilization_pct, gpu.memory_used_mib, gpu.memory_total_mib) == (100, 20085, 143771)
    assert snap.gpus[0].processes == [GpuProcess(568, 0, 20076, "python3")]
    assert snap.gpus[1].processes == [GpuProcess(569, 1, 20076, "python3")]


def test_busy_fixture_agrees_with_the_plain_nvidia_smi_table():
    # The human-readable table of the same moment lists "GPU ... PID Type Process name ... MiB" rows.
    rows = re.findall(r"\|\s+(\d+)\s+N/A\s+N/A\s+(\d+)\s+C\s+(\S+)\s+(\d+)MiB", fixture("nvidia-smi-busy.txt"))
    table = sorted((int(g), int(pid), name, int(mib)) for g, pid, name, mib in rows)
    parsed = sorted(
        (p.gpu_index, p.pid, p.process_name, p.used_memory_mib) for g in snapshot("busy").gpus for p in g.processes
    )
    assert table == parsed == [(0, 568, "python3", 20076), (1, 569, "python3", 20076)]
    assert "No running processes found" in fixture("nvidia-smi-idle.txt")
    assert "0MiB / 143771MiB" in fixture("nvidia-smi-idle.txt")


def test_busy_fixture_agrees_with_the_xml_report():
    # The XML was captured a minute later (other pids), so compare what does not change between the two.
    root = ET.fromstring(fixture("nvidia-smi-q-busy.xml"))
    xml_gpus = [
        (
            int(g.findtext("minor_number")),
            g.findtext("uuid"),
            g.findtext("product_name"),
            int(g.findtext("utilization/gpu_util").split()[0]),
            int(g.findtext("fb_memory_usage/used").split()[0]),
            int(g.findtext("fb_memory_usage/total").split()[0]),
            [int(p.findtext("used_memory").split()[0]) for p in g.iter("process_info")],
        )
        for g in root.iter("gpu")
    ]
    parsed = [
        (g.index, g.uuid, g.name, g.utilization_pct, g.memory_used_mib, g.memory_total_mib,
         [p.used_memory_mib for p in g.processes])
        for g in snapshot("busy").gpus
    ]
    assert parsed == xml_gpus


def test_busy_fixture_holders_and_free_gpus():
    snap = snapshot("busy")
    holders = foreign_gpu_holders(snap, set(), None)
    assert [(p.pid, p.gpu_index) for p in holders] == [(568, 0), (569, 1)]
    assert holders_message(holders) == (
        "GPU 0 is held by pid 568 (python3, 20076 MiB); GPU 1 is held by pid 569 (python3, 20076 MiB)"
    )
    assert pick_free_gpus(snap, 1, set()) is None
    # Our own run on GPU 0 leaves GPU 1 held by someone else.
    assert [p.pid for p in foreign_gpu_holders(snap, {568}, [0, 1])] == [569]
    assert foreign_gpu_holders(snap, {568}, [0]) == []
    assert pick_free_gpus(snap, 1, {568}) == [0]
    assert pick_free_gpus(snap, 2, {568}) is None
    assert pick_free_gpus(snap, 2, {568, 569}) == [0, 1]


def test_snapshot_to_dict_is_json_ready():
    data = snapshot("busy").to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["available"] is True and data["message"] is None
    assert data["gpus"][0]["processes"][0] == {
        "pid": 568, "gpu_index": 0, "used_memory_mib": 20076, "process_name": "python3", "user": None,
    }


def test_user_lookup_fills_holders_message():
    snap = snapshot("busy")
    attach_users(snap, {568: "alice", 569: "bob", 4: None})
    assert holders_message(foreign_gpu_holders(snap, set(), [0])) == (
        "GPU 0 is held by pid 568 (python3, user alice, 20076 MiB)"
    )
    assert snap.gpus[1].processes[0].user == "bob"


@pytest.mark.parametrize(
    ("rc", "stdout", "stderr", "words"),
    [
        (127, "", "bash: line 1: nvidia-smi: command not found\n", "nvidia-smi is not installed"),
        (127, "", "", "nvidia-smi is not installed"),
        (127, "", "sh: 1: nvidia-smi: not found\n", "nvidia-smi is not installed"),
        (
            9,
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
            "latest NVIDIA driver is installed and running.\n",
            "",
            "driver is not loaded",
        ),
        (6, "No devices were found\n", "", "finds no device"),
        (0, "", "", "lists none"),
        (0, "\n  \n", "", "lists none"),
        (15, "", "Unable to determine the device handle for GPU0000:00:06.0: Unknown Error\n", "exit code 15"),
    ],
)
def test_hosts_without_usable_gpus_say_why(rc, stdout, stderr, words):
    snap = snapshot_from_outputs(rc, stdout, "", stderr)
    assert snap.available is False
    assert snap.gpus == []
    assert words in snap.message
    assert foreign_gpu_holders(snap, set(), None) == []
    assert pick_free_gpus(snap, 1, set()) is None


def test_a_failed_process_query_does_not_pass_for_free_gpus():
    snap = snapshot_from_outputs(0, fixture("query-gpu-busy.csv"), "", "Unknown Error", apps_rc=15)
    assert snap.available is False
    assert "who holds the GPUs is unknown" in snap.message
    assert pick_free_gpus(snap, 1, set()) is None


def test_unknown_error_message_quotes_the_output():
    snap = snapshot_from_outputs(15, "", "", "Unable to determine the device handle for GPU0000:00:06.0: Unknown Error")
    assert "Unable to determine the device handle" in snap.message


def test_garbled_output_is_unavailable_not_a_crash():
    snap = snapshot_from_outputs(0, "0, GPU-x, H200, lots, 1, 2\n", "", "")
    assert snap.available is False
    assert "expected a number" in snap.message


def test_not_available_values_blank_lines_and_trailing_spaces():
    gpus = parse_gpus(
        "\n0, GPU-a, NVIDIA A100-SXM4-80GB, [N/A], [Not Supported], 81920   \n\n"
        "1, GPU-b, Tesla T4, 7, 100, [N/A]  \r\n",
        "  \n",
    )
    assert gpus == [
        Gpu(0, "GPU-a", "NVIDIA A100-SXM4-80GB", None, None, 81920, []),
        Gpu(1, "GPU-b", "Tesla T4", 7, 100, None, []),
    ]


def test_gpus_are_ordered_by_index_and_names_may_hold_commas():
    gpus = parse_gpus("1, GPU-b, Odd, Name, 5, 6, 7\n0, GPU-a, Plain, 1, 2, 3\n", "")
    assert [(g.index, g.name, g.utilization_pct) for g in gpus] == [(0, "Plain", 1), (1, "Odd, Name", 5)]


def test_a_gpu_with_two_processes_some_ours_some_foreign():
    gpus_csv = "0, GPU-a, NVIDIA H100 80GB HBM3, 97, 61000, 81559\n1, GPU-b, NVIDIA H100 80GB HBM3, 0, 4, 81559\n"
    apps_csv = (
        "4100, GPU-a, 30000, /usr/bin/python3\n"
        "4242, GPU-a, [N/A], python3 -m vllm.entrypoints, api_server\n"
        "No running processes found\n"
    )
    snap = snapshot_from_outputs(0, gpus_csv, apps_csv, "")
    gpu0 = snap.gpus[0]
    assert [(p.pid, p.used_memory_mib, p.process_name) for p in gpu0.processes] == [
        (4100, 30000, "/usr/bin/python3"),
        (4242, None, "python3 -m vllm.entrypoints, api_server"),
    ]
    assert snap.gpus[1].processes == []

    ours = {4100}
    holders = foreign_gpu_holders(snap, ours, [0])
    assert [p.pid for p in holders] == [4242]
    assert holders_message(holders) == "GPU 0 is held by pid 4242 (python3 -m vllm.entrypoints, api_server)"
    assert foreign_gpu_holders(snap, ours, [1]) == []
    assert pick_free_gpus(snap, 1, ours) == [1]
    assert pick_free_gpus(snap, 2, ours) is None
    assert pick_free_gpus(snap, 2, {4100, 4242}) == [0, 1]

    both = foreign_gpu_holders(snap, set(), None)
    attach_users(snap, {4242: "carol"})
    assert holders_message(both) == (
        "GPU 0 is held by pid 4100 (/usr/bin/python3, 30000 MiB) and pid 4242 (python3 -m vllm.entrypoints, "
        "api_server, user carol)"
    )


def test_processes_that_cannot_be_attributed_are_dropped():
    gpus = parse_gpus("0, GPU-a, X, 0, 0, 10\n", "[N/A], GPU-a, 5, ghost\n12, GPU-zzz, 5, elsewhere\n")
    assert gpus[0].processes == []


def test_malformed_lines_raise():
    with pytest.raises(ValueError, match="fewer than 6 fields"):
        parse_gpus("0, GPU-a, H200\n", "")
    with pytest.raises(ValueError, match="fewer than 4 fields"):
        parse_gpus("0, GPU-a, X, 0, 0, 10\n", "12, GPU-a\n")
    with pytest.raises(ValueError, match="no index"):
        parse_gpus("[N/A], GPU-a, X, 0, 0, 10\n", "")


def test_pick_free_gpus_prefers_lowest_indices_and_rejects_zero():
    csv = "".join(f"{i}, GPU-{i}, H200, 0, 0, 100\n" for i in range(4))
    snap = snapshot_from_outputs(0, csv, "9, GPU-0, 10, other\n77, GPU-2, 10, mine\n", "")
    assert pick_free_gpus(snap, 2, {77}) == [1, 2]
    assert pick_free_gpus(snap, 3, {77}) == [1, 2, 3]
    assert pick_free_gpus(snap, 4, {77}) is None
    with pytest.raises(ValueError, match="at least one GPU"):
        pick_free_gpus(snap, 0, set())


def test_holders_message_of_nobody_is_empty():
    assert holders_message([]) == ""


def test_gpu_parsing_needs_no_torch():
    code = "import sys, worker.gpus; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2]).returncode == 0
