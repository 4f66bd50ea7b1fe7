"""The verifier head loader on quantized checkpoints sharded over several files, as int4 MoE releases ship them."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.verifier_model import load_verifier_head, read_verifier_config
from trainer.vocab import build_vocab_mapping

VOCAB, HIDDEN, LAYERS = 96, 16, 2


def write_int4_checkpoint(directory: Path, quantize: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint in three shards with an index: decoder layers in compressed-tensors int4 (weight_packed,
    weight_scale, weight_shape), embedding / final norm / lm_head in bf16, unless `quantize` names one of
    them with the scheme to store it in ("int4", "gptq" or "fp8")."""
    torch.manual_seed(0)
    plain = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN).to(torch.bfloat16),
        "model.norm.weight": (1 + 0.1 * torch.randn(HIDDEN)).to(torch.bfloat16),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN).to(torch.bfloat16),
    }
    shards: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for layer in range(LAYERS):
        for name in ("self_attn.q_proj", "mlp.experts.0.down_proj"):
            prefix = f"model.layers.{layer}.{name}"
            shards[layer][f"{prefix}.weight_packed"] = torch.randint(0, 2**31 - 1, (HIDDEN, HIDDEN // 8), dtype=torch.int32)
            shards[layer][f"{prefix}.weight_scale"] = torch.rand(HIDDEN, HIDDEN // 32 or 1).to(torch.bfloat16)
            shards[layer][f"{prefix}.weight_shape"] = torch.tensor([HIDDEN, HIDDEN])
        shards[layer][f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    for name, tensor in plain.items():
        module = name.removesuffix(".weight")
        scheme = (quantize or {}).get(module)
        if scheme == "int4":
            shards[2][f"{module}.weight_packed"] = torch.zeros(tensor.shape[0], max(1, tensor.shape[-1] // 8), dtype=torch.int32)
            shards[2][f"{module}.weight_scale"] = torch.ones(tensor.shape[0], 1, dtype=torch.bfloat16)
        elif scheme == "gptq":
            shards[2][f"{module}.qweight"] = torch.zeros(max(1, tensor.shape[-1] // 8), tensor.shape[0], dtype=torch.int32)
            shards[2][f"{module}.scales"] = torch.ones(1, tensor.shape[0], dtype=torch.float16)
        elif scheme == "fp8":
            shards[2][f"{module}.weight"] = tensor.to(torch.float8_e4m3fn)
        else:
            shards[2][name] = tensor
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file))
        weight_map.update(dict.fromkeys(shard, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "ignore": ["lm_head"], "config_groups": {"group_0": {"weights": {"num_bits": 4}}}},
    }))
    return plain


def test_int4_checkpoint_with_unquantized_embedding_norm_and_head_loads(tmp_path):
    plain = write_int4_checkpoint(tmp_path)
    d2t, t2d = build_vocab_mapping(torch.arange(VOCAB), VOCAB, 32)
    head, embed = load_verifier_head(tmp_path, d2t, t2d)
    assert torch.equal(embed, plain["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head_weight, plain["lm_head.weight"])
    assert torch.equal(head.norm_weight, plain["model.norm.weight"].float())
    assert read_verifier_config(tmp_path)["num_hidden_layers"] == LAYERS


@pytest.mark.parametrize(("module", "scheme", "names"), [
    ("lm_head", "int4", "lm_head.weight_packed, lm_head.weight_scale"),
    ("model.embed_tokens", "gptq", "model.embed_tokens.qweight, model.embed_tokens.scales"),
    ("model.norm", "fp8", "model.norm.weight (F8_E4M3)"),
])
def test_a_quantized_embedding_norm_or_head_is_refused_by_name(tmp_path, module, scheme, names):
    write_int4_checkpoint(tmp_path, {module: scheme})
    d2t, t2d = build_vocab_mapping(torch.arange(VOCAB), VOCAB, 32)
    with pytest.raises(ValueError) as error:
        load_verifier_head(tmp_path, d2t, t2d)
    message = str(error.value)
    assert f"the verifier's {module} is stored quantized" in message and names in message
    assert f"Write an unquantized `{module}.weight` (bf16)" in message
