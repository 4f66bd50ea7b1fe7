"""benchmarks/decode_tp.py on this CPU: the tensor-parallel decode (two gloo ranks) runs at every depth, its
accepted tokens per round follow the acceptance curve, and the advisor's prediction is set beside each depth;
the static-shape decode (what the GPU captures as CUDA graphs) emits what the eager decode does.
The timings themselves mean nothing here; the integrator's H200 run is in docs/benchmarks.md."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import decode_tp

ROOT = Path(__file__).resolve().parent.parent


def test_the_static_decode_emits_what_the_eager_decode_does() -> None:
    """Same weights, prompt and acceptance: every round's proposals, verifier tokens, emitted tokens and verifier
    features agree, over rounds that accept 0 to 3 of 3 proposals (1 to 4 valid rows of the padded draft step)."""
    config, depth, prompt_tokens, new_tokens = dict(decode_tp.TINY), 3, 16, 60
    max_len = prompt_tokens + new_tokens + 2 * depth + 8
    cpu = torch.device("cpu")
    verifier = decode_tp.TPVerifier(config, 0, 1, cpu, torch.float32, max_len)
    draft = decode_tp.build_draft(argparse.Namespace(draft=None, config=config), verifier.embed, cpu, torch.float32)
    drafter = decode_tp.DraftRunner(draft, max_len)
    prompt = torch.randint(0, config["vocab_size"], (prompt_tokens,), generator=torch.Generator().manual_seed(3))
    curve, eager, static = [0.9, 0.7, 0.5], [], []
    with torch.inference_mode():
        decode_tp.decode(verifier, drafter, prompt, depth, new_tokens, curve, lambda: None, eager)
        decoder = decode_tp.StaticDecode(verifier, drafter, depth, capture=False)
        decode_tp.decode_static(decoder, prompt, depth, new_tokens, curve, lambda: None, static)
    assert len(static) == len(eager) > 10
    assert {len(record["emitted"]) for record in static} == {1, 2, 3, 4}
    for round_index, (ours, theirs) in enumerate(zip(static, eager, strict=True)):
        for key in ("proposals", "verified", "emitted"):
            assert ours[key] == theirs[key], (round_index, key)
        torch.testing.assert_close(ours["features"], theirs["features"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two torch processes decoding
def test_the_decode_benchmark_measures_every_depth_and_compares_with_the_advisor(tmp_path: Path, capsys) -> None:
    curve = [0.9, 0.7, 0.5]
    # the benchmark's main in this process, which spawns its two gloo ranks as the script does (the script's own
    # start-up, a torch import of its own, is the smoke test's below); one timed call per sweep timing: the table's
    # sizes are what is asserted, not its times
    assert decode_tp.main(
        ["--out", str(tmp_path), "--device", "cpu", "--tiny", "--tp", "2", "--max-depth", "3", "--new-tokens", "48",
         "--prompt-tokens", "16", "--repeats", "2", "--decode-repeats", "2", "--sweep-iters", "1",
         "--links", "p2p-disabled", "--acceptance", ",".join(map(str, curve))]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["decode_path"] == "static"  # the code a GPU captures, run uncaptured
    assert [(link["link"], link["env"]) for link in results["links"]] == [("p2p-disabled", {"NCCL_P2P_DISABLE": "1"})]
    for link in results["links"]:
        assert [row["depth"] for row in link["decode"]] == [0, 1, 2, 3]
        assert all(row["tokens"] >= 48 and row["tokens_per_second"] > 0 for row in link["decode"])
        assert all(row["tokens_per_second_min_time"] >= row["tokens_per_second"] for row in link["decode"])
        # tokens per round follow the curve's τ = 1 + a_1 + ... + a_d
        for row in link["decode"]:
            assert row["mean_accepted"] == pytest.approx(1 + sum(curve[:row["depth"]]), abs=0.12)
        assert link["allreduce"] and {row["bytes"] for row in link["allreduce"]} >= {64 * 2 * t for t in (1, 2, 3, 4)}
    [compared] = results["comparison"]
    assert set(compared["predicted"]) == {"0", "1", "2", "3"} and 0 <= compared["recommended_depth"] <= 3
    table = (tmp_path / "table.md").read_text()
    assert "| depth | τ (curve) | τ (decode) | predicted tokens/s | measured tokens/s |" in table
    assert "fastest run tokens/s" in table and "Decode: static, median and fastest of 2 runs" in table
    assert "Depth the advisor picks" in capsys.readouterr().out


@pytest.mark.slow  # a torch process decoding
def test_the_eager_decode_runs_on_request_and_the_smoke_run_is_small(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_tp.py"), "--out", str(tmp_path), "--device", "cpu",
         "--tiny", "--tp", "1", "--smoke", "--prompt-tokens", "16", "--no-cuda-graphs", "--acceptance", "0.9,0.7,0.5"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["decode_path"], results["max_depth"], results["new_tokens"]) == ("eager", 3, 64)
    [link] = results["links"]
    assert link["allreduce"] == [] and [row["depth"] for row in link["decode"]] == [0, 1, 2, 3]
    assert [row["mean_accepted"] for row in link["decode"]] == pytest.approx([1, 1.9, 2.6, 3.1], abs=0.12)
    assert all(len(row["runs_seconds"]) == 1 for row in link["decode"])


def test_the_decode_benchmark_refuses_more_ranks_than_gpus_and_a_rising_curve(tmp_path: Path, capsys) -> None:
    """Both refused by main before anything starts, so in this process: the script exits with its SystemExit."""
    with pytest.raises(SystemExit) as gpus:
        decode_tp.main(["--out", str(tmp_path), "--device", "cuda", "--tp", "64"])
    assert gpus.value.code == 2 and "tp=64 needs 64 GPUs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as rising:
        decode_tp.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--max-depth", "2",
                        "--acceptance", "0.5,0.7"])
    # a message for an exit code: python prints it to stderr and exits with status 1
    assert isinstance(rising.value.code, str) and "non-increasing" in rising.value.code
    assert not list(tmp_path.iterdir()), "refused before writing anything"
