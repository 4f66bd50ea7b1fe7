"""The draft's attention shape (`--draft-num-heads`, `--draft-num-kv-heads`, `--draft-head-dim`, the DeepSeek-V3 /
Kimi-K2 family default) and a YaRN-scaled verifier's RoPE, carried into the export and equal to the verifier's own
past its original 4k context."""

# transformers' DeepSeek-V3 and Llama are imported by the tests that build them, not at collection (some seconds of
# CPU in every pytest process that collects this module)
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import pytest
import torch

from tests.trainer.tiny_setup import build_dataset, build_verifier
from trainer.model import (
    DraftConfig,
    EagleDraft,
    load_draft,
    read_draft_config,
    save_draft,
    speculators_config,
)
from trainer.train import main as train_main

if TYPE_CHECKING:
    from transformers import DeepseekV3ForCausalLM

# DeepSeek-V3's (and Kimi-K2's) rope parameters; the shapes are shrunk but for the rotary dimension
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
POSITIONS = torch.tensor([0, 1, 100, 2047, 4095, 4096, 5000, 8191, 16384, 65536, 163839])


def tiny_deepseek(rope: dict) -> DeepseekV3ForCausalLM:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=128, v_head_dim=16, max_position_embeddings=163840, rope_parameters=dict(rope),
    )
    return DeepseekV3ForCausalLM(config).eval()


def test_a_deepseek_verifier_gets_the_draft_shape_the_engines_serve():
    verifier = tiny_deepseek(YARN).config.to_dict()
    config = DraftConfig.from_verifier(verifier, draft_vocab_size=32, ttt_steps=1)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (56, 8, 128)
    config = DraftConfig.from_verifier(verifier, 32, 1, num_heads=8, num_kv_heads=2, head_dim=64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 64)
    with pytest.raises(ValueError, match="8 KV heads"):
        DraftConfig.from_verifier(verifier, 32, 1, num_heads=12)


@pytest.mark.parametrize("rope", [YARN, {k: v for k, v in YARN.items() if not k.startswith("mscale")}],
                         ids=["deepseek-mscale", "plain-yarn"])
def test_yarn_rope_is_exported_and_equals_the_verifiers_own_past_4k(tmp_path, rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    verifier = tiny_deepseek(rope)
    # 4 heads of 128 (the family's head_dim): transformers' LlamaConfig wants the hidden size a multiple of the heads
    draft = EagleDraft(DraftConfig.from_verifier(verifier.config.to_dict(), 32, 1, num_heads=4, num_kv_heads=2))
    save_draft(draft, tmp_path)
    engine = json.loads((tmp_path / "config.json").read_text())
    assert engine["rope_scaling"]["rope_type"] == "yarn" and engine["rope_scaling"]["factor"] == 40.0
    assert speculators_config(draft.config)["transformer_layer_config"]["rope_parameters"]["rope_type"] == "yarn"

    x = torch.zeros(1, POSITIONS.numel(), 64)
    with torch.no_grad():
        cos, sin = verifier.model.rotary_emb(x, POSITIONS[None])
    for reread in (draft, load_draft(tmp_path)):
        our_cos, our_sin = reread.rope(POSITIONS)
        torch.testing.assert_close(our_cos, cos[0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(our_sin, sin[0], atol=2e-5, rtol=1e-5)

    # vLLM / SGLang build a Llama draft's YaRN from these keys only and scale cos/sin by (0.1 ln f + 1) x attn_factor
    # (vllm/model_executor/layers/rotary_embedding/__init__.py @ 07b12f1): the product is the verifier's factor
    exported = engine["rope_scaling"]
    vllm_mscale = (0.1 * math.log(exported["factor"]) + 1) * exported.get("attn_factor", 1.0)
    assert vllm_mscale == pytest.approx(float(cos[0, 0, 0]), rel=1e-6)  # cos(0) x the verifier's factor

    # a Llama-architecture engine reads the exported rope_scaling with transformers' own Llama RoPE
    llama = LlamaConfig.from_pretrained(tmp_path)
    with torch.no_grad():
        llama_cos, _ = LlamaRotaryEmbedding(llama)(x, POSITIONS[None])
    torch.testing.assert_close(llama_cos[0], cos[0], atol=2e-5, rtol=1e-5)


def test_draft_shape_flags_train_and_export(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        verifier = build_verifier(tmp_path / "verifier")
        build_dataset(verifier, tmp_path / "data", samples=8)
        assert train_main([
            "--verifier-path", str(tmp_path / "verifier"), "--data-dir", str(tmp_path / "data" / "hidden_states"),
            "--vocab-mapping-dir", str(tmp_path / "data" / "vocab_mapping"), "--output-dir", str(tmp_path / "out"),
            "--max-steps", "2", "--max-seq-len", "48", "--num-workers", "0", "--val-ratio", "0",
            "--draft-num-heads", "8", "--draft-num-kv-heads", "2", "--draft-head-dim", "32",
        ]) == 0
    finally:
        torch.set_num_threads(threads)
    config = read_draft_config(tmp_path / "out")
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 32)
    assert load_draft(tmp_path / "out").midlayer.self_attn.o_proj.weight.shape == (64, 8 * 32)
