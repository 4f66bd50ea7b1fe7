"""The engines as their released code runs them (issue 54, 5): a vLLM release that refuses the verifier's
architecture for EAGLE-3 is named instead of priced; SGLang's replicated MLA A-projection, its replicated EAGLE-3
`fc` and its dp-attention are priced as SGLang runs them (file and version in server/advisor/engine.py and
verifier.py)."""

import pytest

from server.advisor import CostModel, Drafting, EngineCost
from server.advisor.engine import vllm_eagle3_refusal
from server.advisor.releases import VLLM_EAGLE3
from server.advisor.tables import DEFAULT_HBM_BYTES_PER_S, pcie_allreduce_us
from server.advisor.verifier import Parallelism, VerifierShape, read_config, verifier_cost
from tests.unit.test_verifier_cost import KIMI, LLAMA


def _minor_releases(first: str, last: str) -> list[str]:
    return [f"0.{minor}.0" for minor in range(int(first.split(".")[1]), int(last.split(".")[1]) + 1)]


def test_vllm_refuses_an_eagle3_draft_for_kimi_and_deepseek_until_0_18_and_serves_them_from_it() -> None:
    """vLLM's wheels, every minor release 0.11.0 to 0.34.0 (server/advisor/releases.py VLLM_EAGLE3): up to 0.16.0
    config/speculative.py eagle3_target_supported refuses a kimi_k2 / deepseek_v3 model_type; 0.17.0 drops that list
    but DeepseekV3ForCausalLM and KimiK25ForConditionalGeneration lack SupportsEagle3 (the model runner stops at
    load); from 0.18.0 both implement it."""
    kimi = VerifierShape.from_config(read_config(str(KIMI)))
    assert (kimi.model_type, kimi.architecture) == ("kimi_k2", "KimiK25ForConditionalGeneration")
    targets = [("kimi_k2", "KimiK25ForConditionalGeneration"), ("kimi_k2", "DeepseekV3ForCausalLM"),
               ("deepseek_v3", "DeepseekV3ForCausalLM")]
    assert tuple(VLLM_EAGLE3) == tuple(_minor_releases("0.11.0", "0.34.0"))  # every minor release read
    for version in _minor_releases("0.11.0", "0.34.0"):
        minor = int(version.split(".")[1])
        for model_type, architecture in targets:
            refusal = vllm_eagle3_refusal(version, model_type, architecture)
            if minor < 17:
                assert refusal.startswith(f"vLLM {version} refuses an EAGLE-3 draft for a {model_type!r} verifier")
                assert f"vllm {version} config/speculative.py:" in refusal and "llama, qwen, minicpm" in refusal
            elif minor == 17:
                assert refusal.startswith(f"vLLM 0.17.0 refuses an EAGLE-3 draft for a {architecture} verifier")
                assert "SupportsEagle3" in refusal and "vllm 0.17.0 v1/worker/gpu_model_runner.py:4307" in refusal
            else:
                assert refusal is None, (version, architecture, refusal)
        assert vllm_eagle3_refusal(version, "llama", "LlamaForCausalLM") is None
    assert vllm_eagle3_refusal("0.34.0", "glm4_moe", "Glm4MoeForCausalLM")  # no SupportsEagle3 in any release read
    # Qwen3-MoE: its model_type is listed from 0.11.0, its class implements SupportsEagle3 from 0.12.0
    assert "SupportsEagle3" in vllm_eagle3_refusal("0.11.0", "qwen3_moe", "Qwen3MoeForCausalLM")
    assert vllm_eagle3_refusal("0.12.0", "qwen3_moe", "Qwen3MoeForCausalLM") is None
    # a patch release follows its minor release, and says so
    assert "(0.17.1 follows 0.17.0)" in vllm_eagle3_refusal("0.17.1", *targets[0])
    assert vllm_eagle3_refusal("0.18.1", *targets[0]) is None
    # no version (or v1): the newest read; outside those read: unverified, not assumed
    assert vllm_eagle3_refusal(None, *targets[0]) is None and vllm_eagle3_refusal("v1", *targets[0]) is None
    for version, edge in (("0.35.0", "newer than the newest"), ("1.0", "newer than the newest"),
                          ("v0", "older than the oldest"), ("0.10.2", "older than the oldest")):
        refusal = vllm_eagle3_refusal(version, "llama", "LlamaForCausalLM")
        assert f"is {edge} release read" in refusal and "unverified" in refusal, refusal
    assert "engine_version 0.34.0" in vllm_eagle3_refusal("0.35.0", *targets[0])


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
