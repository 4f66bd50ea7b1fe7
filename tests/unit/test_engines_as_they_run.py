"""The engines as their released code runs them (issue 54, 5): a vLLM release that refuses the verifier's
architecture for EAGLE-3 is named instead of priced; SGLang's replicated MLA A-projection, its replicated EAGLE-3
`fc` and its dp-attention are priced as SGLang runs them (file and version in server/advisor/engine.py and
verifier.py)."""

import pytest

from server.advisor import CostModel, Drafting, EngineCost
from server.advisor.engine import vllm_eagle3_refusal
from server.advisor.tables import DEFAULT_HBM_BYTES_PER_S, pcie_allreduce_us
from server.advisor.verifier import Parallelism, VerifierShape, read_config, verifier_cost
from tests.unit.test_verifier_cost import KIMI, LLAMA


def test_vllm_refuses_an_eagle3_draft_for_kimi_and_deepseek_and_serves_llama_and_qwen() -> None:
    for version in ("0.11.0", "0.12.0", None):
        refusal = vllm_eagle3_refusal(version, "kimi_k2")
        assert refusal and "vllm/config/speculative.py" in refusal and "llama, qwen, minicpm, gpt_oss" in refusal
        assert vllm_eagle3_refusal(version, "deepseek_v3")
        assert vllm_eagle3_refusal(version, "llama") is None and vllm_eagle3_refusal(version, "qwen3_moe") is None
    # a release not read is judged by the newest read one before it, and says so
    assert "judged by 0.11.0" in vllm_eagle3_refusal("0.11.2", "kimi_k2")
    assert VerifierShape.from_config(read_config(str(KIMI))).model_type == "kimi_k2"


def test_sglang_reads_the_mla_a_projection_whole_on_every_rank() -> None:
    shape = VerifierShape.from_config(read_config(str(KIMI)), "kimi")
    sliced = verifier_cost(shape, Parallelism(8))
    replicated = verifier_cost(shape, Parallelism(8, mla_a_replicated=True))
    a_proj = shape.layers * shape.hidden * (shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim) * 2
    assert a_proj * 7 / 8 / 1e9 == pytest.approx(1.6, abs=0.05)  # the "about 1.6 GB per GPU per step" more
    assert replicated.fixed_ms - sliced.fixed_ms == pytest.approx(a_proj * 7 / 8 / DEFAULT_HBM_BYTES_PER_S * 1e3)
    assert "ReplicatedLinear" in replicated.basis["verifier_forward"]


def test_sglang_reads_the_eagle3_fc_whole_and_dp_attention_puts_the_draft_on_its_own_group() -> None:
    shape = VerifierShape.from_config(read_config(str(LLAMA)), "llama")
    cost = CostModel.for_verifier(shape, Parallelism(8), pcie_allreduce_us(8))
    sglang, dp = EngineCost(cost, Drafting("sglang")), EngineCost(cost, Drafting("sglang", attention_dp=8))
    fc = 3 * shape.hidden * shape.hidden * 2 * 7 / 8 / DEFAULT_HBM_BYTES_PER_S * 1e3
    sharded = sglang.terms(3)
    assert sharded.draft_compute_ms == pytest.approx(cost.draft_round_ms + 3 * cost.draft_step_ms / 8 + fc)
    # dp-attention at dp 8: the draft on one rank, its whole weights read per forward and no collective of its own
    alone = dp.terms(3)
    assert alone.draft_allreduces == 0 and alone.draft_allreduce_ms == 0
    assert alone.draft_compute_ms == pytest.approx(cost.draft_round_ms + 3 * cost.draft_step_ms)
    assert "draft_parallel.py" in Drafting("sglang", attention_dp=8).placement(8)
    # the verifier's attention sliced over tp / dp ranks
    whole = verifier_cost(shape, Parallelism(8, attention_dp=8))
    attention = shape.layers * shape.attention_params * 2
    assert whole.fixed_ms - verifier_cost(shape, Parallelism(8)).fixed_ms == pytest.approx(
        attention * 7 / 8 / DEFAULT_HBM_BYTES_PER_S * 1e3)
    with pytest.raises(ValueError, match="dp-attention"):
        Drafting("vllm", attention_dp=2)
