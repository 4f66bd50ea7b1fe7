"""probe-verifier's pieces that run without a GPU: the host script refuses clearly where it cannot measure, and a
measurement (here one of the shape a probe answers) read back prices the verifier's forward as measured."""

import json

import pytest

from server.advisor import CostModel
from server.advisor.tables import NVLINK_ALLREDUCE_US
from server.advisor.verifier import Parallelism, VerifierShape, read_config, read_probe
from tests.unit.test_verifier_cost import KIMI
from worker import verifier_probe


def cuda_available() -> bool:
    import torch  # at the test's setup (the skipif below is a string, evaluated then), not at collection

    return torch.cuda.is_available()


@pytest.mark.skipif("cuda_available()", reason="this box has a GPU: the probe would measure")
def test_the_probe_refuses_with_no_gpu_on_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert verifier_probe.main(["--config", str(KIMI), "--tp", "8"]) == verifier_probe.CANNOT_MEASURE
    answer = json.loads(capsys.readouterr().out)
    assert answer["error"].startswith("no GPU on ")
    with pytest.raises(ValueError, match="could not measure: no GPU on"):
        read_probe(answer, "serve-box", "2026-12-04T00:00:00Z")


def test_a_stored_probe_prices_the_forward_as_measured_and_says_where() -> None:
    config = read_config(str(KIMI))
    answer = {"path": str(KIMI), "config": config, "tp": 8, "gpu": "NVIDIA H200", "dtype": "int4",
              "dense_ms": [0.05 + 0.001 * n for n in range(16)], "moe_ms": [0.1 + 0.01 * n for n in range(16)]}
    stored = read_probe(answer, "serve-box", "2026-12-04T00:00:00Z")
    shape = VerifierShape.from_config(config, "kimi-k2.5")
    cost = CostModel.for_verifier(shape, Parallelism(8), NVLINK_ALLREDUCE_US, measured=stored)
    head = 163840 * 7168 * 2 / 8 / 3.5e12 * 1000  # the lm head's bf16 read, modelled
    assert cost.verifier_ms(0) == pytest.approx(1 * 0.05 + 60 * 0.1 + head)
    assert cost.verifier_ms(15) == pytest.approx(1 * 0.065 + 60 * 0.25 + head)
    assert cost.basis["verifier_forward"].startswith("measured on serve-box by probe-verifier")
    # beyond the 16 tokens timed: the last time plus the model's growth
    assert cost.verifier_ms(20) > cost.verifier_ms(15)
    with pytest.raises(ValueError, match="not a list"):
        read_probe({**answer, "moe_ms": [1.0, "x"]}, "serve-box", "t")
    with pytest.raises(ValueError, match="tp=2 ep=1 layer"):
        CostModel.for_verifier(shape, Parallelism(8), NVLINK_ALLREDUCE_US, measured={**stored, "tp": 2})


def test_the_h200_probe_of_kimi_k25_prices_a_16_token_forward_as_measured() -> None:
    # captured on one H200 (worker/verifier_probe.py --tp 8 --ep 8): 1 dense + 60 MoE layers of the tp=8 share
    captured = json.loads((KIMI.parents[1] / "verifier-probe" / "kimi-k2.5-tp8-ep8.json").read_text())
    stored = read_probe(captured, "h200", "2026-12-04T02:35:00Z")
    assert stored["dtype"] == "int4" and len(stored["moe_ms"]) == 16
    shape = VerifierShape.from_config(stored["config"], "kimi-k2.5")
    cost = CostModel.for_verifier(shape, Parallelism(8, ep=8), NVLINK_ALLREDUCE_US, measured=stored)
    head = 163840 * 7168 * 2 / 8 / 3.5e12 * 1000
    assert cost.verifier_ms(15) == pytest.approx(captured["dense_ms"][15] + 60 * captured["moe_ms"][15] + head)
    assert cost.verifier_ms(15) > cost.verifier_ms(0)


def test_the_probes_layers_of_an_mla_moe_shape_run_at_every_token_count() -> None:
    # a tiny DeepSeek/Kimi-shaped config on the CPU (bf16, one matmul per expert: no grouped kernel here): the
    # absorbed MLA attention over the shared latent and the routed experts give one row per token
    import torch

    tiny = {"hidden_size": 64, "num_attention_heads": 8, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 16,
            "num_experts_per_tok": 4, "moe_intermediate_size": 32, "n_shared_experts": 1, "intermediate_size": 128}
    for moe in (False, True):
        for tokens in (1, 5):
            out = verifier_probe.build_layer(torch, tiny, 2, 2 if moe else 1, moe, 64, "bf16", tokens,
                                             torch.device("cpu"))()
            assert out.shape == (tokens, 64) and torch.isfinite(out.float()).all()


def test_the_reconciliation_sets_the_model_against_a_probe_token_by_token(capsys: pytest.CaptureFixture) -> None:
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("verifier_reconcile", root / "benchmarks" / "verifier_reconcile.py")
    reconcile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reconcile)
    # the probe of before 2026-12-07 (SDPA over the expanded MLA latent): 22x the model at 1 token, the gap
    assert reconcile.main([str(root / "tests" / "fixtures" / "verifier-probe" / "kimi-k2.5-tp8-ep8.json")]) == 0
    *rows, last = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert len(rows) == 16 and rows[0]["measured_ms"] == pytest.approx(28.2, abs=0.05)
    assert rows[0]["ratio"] == pytest.approx(22.1, abs=0.1) and last["within_1_5x"] is False
    # a dense bf16 verifier's layer: the model within 1.5x of the probe at 1 token
    reconcile.main([str(root / "tests" / "fixtures" / "verifier-probe" / "llama-3-70b-tp8.json")])
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert 1 / 1.5 < first["ratio"] < 1.5
