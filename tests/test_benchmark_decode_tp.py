"""benchmarks/decode_tp.py on this CPU: the tensor-parallel decode (two gloo ranks) runs at every depth, its
accepted tokens per round follow the acceptance curve, and the advisor's prediction is set beside each depth.
The timings themselves mean nothing here; the integrator's H200 run is in docs/benchmarks.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # two torch processes decoding


def test_the_decode_benchmark_measures_every_depth_and_compares_with_the_advisor(tmp_path: Path) -> None:
    curve = [0.9, 0.7, 0.5]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_tp.py"), "--out", str(tmp_path), "--device", "cpu",
         "--tiny", "--tp", "2", "--max-depth", "3", "--new-tokens", "48", "--prompt-tokens", "16", "--repeats", "2",
         "--decode-repeats", "1", "--sweep-iters", "3", "--links", "p2p-disabled",
         "--acceptance", ",".join(map(str, curve))],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(link["link"], link["env"]) for link in results["links"]] == [("p2p-disabled", {"NCCL_P2P_DISABLE": "1"})]
    for link in results["links"]:
        assert [row["depth"] for row in link["decode"]] == [0, 1, 2, 3]
        assert all(row["tokens"] >= 48 and row["tokens_per_second"] > 0 for row in link["decode"])
        # tokens per round follow the curve's τ = 1 + a_1 + ... + a_d
        for row in link["decode"]:
            assert row["mean_accepted"] == pytest.approx(1 + sum(curve[:row["depth"]]), abs=0.12)
        assert link["allreduce"] and {row["bytes"] for row in link["allreduce"]} >= {64 * 2 * t for t in (1, 2, 3, 4)}
    [compared] = results["comparison"]
    assert set(compared["predicted"]) == {"0", "1", "2", "3"} and 0 <= compared["recommended_depth"] <= 3
    table = (tmp_path / "table.md").read_text()
    assert "| depth | τ (curve) | τ (decode) | predicted tokens/s | measured tokens/s |" in table
    assert "Depth the advisor picks" in done.stdout


def test_the_decode_benchmark_refuses_more_ranks_than_gpus_and_a_rising_curve(tmp_path: Path) -> None:
    script = str(ROOT / "benchmarks" / "decode_tp.py")
    gpus = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--device", "cuda", "--tp", "64"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert gpus.returncode == 2 and "tp=64 needs 64 GPUs" in gpus.stderr
    rising = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--device", "cpu", "--tiny",
                             "--max-depth", "2", "--acceptance", "0.5,0.7"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert rising.returncode == 1 and "non-increasing" in rising.stderr
