"""The verifier's cost from its own config.json: a Kimi-K2.5-shaped MoE (MLA, int4) and a Llama-3-70B-shaped dense
model (GQA, bf16), priced on one all-reduce table; every answer names the verifier and each term's basis."""

from pathlib import Path

import pytest

from server.advisor import CostModel, Drafting, advise
from server.advisor.tables import NVLINK_ALLREDUCE_US
from server.advisor.verifier import Parallelism, VerifierShape, name_of, read_config, verifier_cost

VERIFIERS = Path(__file__).resolve().parents[1] / "fixtures" / "verifiers"
KIMI, LLAMA = VERIFIERS / "kimi-k2.5", VERIFIERS / "llama-3-70b"


def shape(path: Path) -> VerifierShape:
    config = read_config(str(path))
    return VerifierShape.from_config(config, name_of(str(path), config))


def test_kimi_k25_is_a_one_trillion_parameter_moe_with_32b_active_mla_and_int4_experts() -> None:
    kimi = shape(KIMI)  # text_config unwrapped from the multimodal wrapper
    assert (kimi.layers, kimi.hidden, kimi.vocab, kimi.attention) == (61, 7168, 163840, "mla")
    assert (kimi.experts, kimi.experts_per_token, kimi.dense_layers, kimi.moe_layers) == (384, 8, 1, 60)
    assert kimi.shared_intermediate == 2048
    assert kimi.total_params == pytest.approx(1.03e12, rel=0.01)
    assert kimi.active_params == pytest.approx(31.7e9, rel=0.01)
    # MLA caches kv_lora_rank + qk_rope_head_dim values per token and layer, in bf16
    assert kimi.kv_bytes_per_token == (512 + 64) * 61 * 2
    # int4 with a bf16 scale per 32 weights: 4.5 bits; attention, shared experts, dense MLPs, lm_head ignored: 16
    bits = kimi.bits
    assert bits.experts == 4.5 and (bits.attention, bits.shared, bits.dense_mlp, bits.lm_head) == (16, 16, 16, 16)
    assert "compressed-tensors int4, group size 32" in kimi.describe() and kimi.name.startswith("kimi-k2.5")


def test_llama_3_70b_is_dense_gqa_bf16_and_reads_what_the_built_in_default_assumes() -> None:
    llama = shape(LLAMA)
    assert (llama.attention, llama.kv_heads, llama.experts, llama.bits.experts) == ("gqa", 8, 0, 16)
    assert llama.total_params == pytest.approx(70.55e9, rel=0.001)
    assert llama.kv_bytes_per_token == 2 * 8 * 128 * 80 * 2
    # 141 GB of weights at 3.5 TB/s over tp=8: the built-in default's 40 ms / 8 within 1 %
    cost = verifier_cost(llama, Parallelism(8), context_tokens=0)
    assert cost.fixed_ms == pytest.approx(40.0 / 8, rel=0.01)
    assert cost.ms(2) - cost.ms(1) == pytest.approx(0.3 / 8, rel=0.01)  # 2 x 70e9 FLOP per token


def test_an_moe_verifier_reads_more_experts_for_every_token_verified_so_deeper_rounds_cost_it_more() -> None:
    kimi, llama = shape(KIMI), shape(LLAMA)
    moe, dense = verifier_cost(kimi, Parallelism(8)), verifier_cost(llama, Parallelism(8))
    # 16 tokens touch 1 - (1 - 8/384)^16 = 28.6 % of the experts, one token 2.1 %
    assert kimi.experts_touched(1) == pytest.approx(8.0)
    assert kimi.experts_touched(16) / 384 == pytest.approx(1 - (1 - 8 / 384) ** 16)
    assert moe.ms(16) / moe.ms(1) > 4 and dense.ms(16) / dense.ms(1) < 1.15


def test_each_layers_collectives_follow_the_parallelism() -> None:
    kimi = shape(KIMI)
    tp = verifier_cost(kimi, Parallelism(8))
    ep = verifier_cost(kimi, Parallelism(8, ep=8))
    assert (tp.allreduce_calls, tp.alltoall_calls) == (2 * 61, 0)
    # expert parallel: one all-reduce per layer (attention), the dense layer's MLP one, dispatch + combine per MoE layer
    assert (ep.allreduce_calls, ep.alltoall_calls) == (61 + 1, 2 * 60)
    assert ep.alltoall_bytes_per_token == 8 * 7168 * 2 and "all-to-all" in ep.basis["verifier_collectives"]
    with pytest.raises(ValueError, match="ep must be 1"):
        Parallelism(8, ep=4)


def test_the_advice_names_the_verifier_it_priced_and_each_terms_basis() -> None:
    positions = [0.8 ** i for i in range(1, 9)]
    for path, words in ((KIMI, "MoE, 384 routed experts"), (LLAMA, "dense, 80 layers")):
        cost = CostModel.for_verifier(shape(path), Parallelism(8), NVLINK_ALLREDUCE_US)
        advice = advise({"position_acceptance": positions}, "nvlink", 8, cost, drafting=Drafting(engine="sglang"))
        model = advice.model_dump(mode="json")["cost_model"]
        assert words in model["priced_verifier"]
        assert model["basis"]["verifier_forward"].startswith("modelled from")
        assert model["basis"]["allreduce_times"].startswith("measured: NCCL all-reduce on 2 H200s")
        assert model["basis"]["draft_step"].startswith("modelled:")
        assert "eagle_worker.py" in model["basis"]["draft_placement"]
    default = advise({"position_acceptance": positions}, "nvlink", 8).model_dump(mode="json")["cost_model"]
    assert default["priced_verifier"].startswith("built-in default: a 70B-class dense verifier")


def test_the_kimi_verifier_serves_shallower_than_the_dense_one_on_the_same_draft() -> None:
    # the same acceptance: each extra token costs the MoE verifier more expert reads, so it stops deeper less often
    positions = [0.85 ** i for i in range(1, 17)]
    depth = {}
    for path in (KIMI, LLAMA):
        cost = CostModel.for_verifier(shape(path), Parallelism(8), NVLINK_ALLREDUCE_US)
        depth[path] = advise({"position_acceptance": positions}, "nvlink", 8, cost,
                             drafting=Drafting(engine="sglang")).recommended_depth
    assert depth[KIMI] < depth[LLAMA]


@pytest.mark.parametrize("config, words", [
    ({"hidden_size": 8}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10,
      "quantization_config": {"quant_method": "exl2"}}, "'exl2' is not one the advisor reads"),
    ({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10,
      "num_local_experts": 8, "num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_a_config_the_advisor_cannot_read_says_what_is_missing(config: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        VerifierShape.from_config(config)


def test_mixtral_and_qwen_moe_names_and_awq_gptq_fp8_bits_are_read() -> None:
    base = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "intermediate_size": 128}
    mixtral = VerifierShape.from_config({**base, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (mixtral.experts, mixtral.expert_intermediate, mixtral.moe_layers) == (8, 128, 4)
    qwen = VerifierShape.from_config({**base, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 256, "mlp_only_layers": [0]})
    assert (qwen.experts, qwen.shared_intermediate, qwen.dense_layers) == (60, 256, 1)
    awq = VerifierShape.from_config({**base, "quantization_config": {"quant_method": "awq", "bits": 4,
                                                                     "group_size": 128}})
    gptq = VerifierShape.from_config({**base, "quantization_config": {"quant_method": "gptq", "bits": 8,
                                                                      "group_size": -1}})
    fp8 = VerifierShape.from_config({**base, "quantization_config": {"quant_method": "fp8"}})
    assert (awq.bits.attention, gptq.bits.attention, fp8.bits.attention) == (4.125, 8, 8)


def test_read_config_takes_a_model_directory_or_its_config_json_and_nothing_else(tmp_path: Path) -> None:
    assert read_config(str(LLAMA)) == read_config(str(LLAMA / "config.json"))
    (tmp_path / "secrets.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json or its model directory"):
        read_config(str(tmp_path / "secrets.json"))
    (tmp_path / "config.json").write_text("x" * (2 << 20))
    with pytest.raises(ValueError, match="larger than"):
        read_config(str(tmp_path))
