"""The smoke decode of `longrun check-draft --verifier`: one greedy speculative decode with the draft built as the
engine reads it (its config's sizes and RoPE, the layers the engine captures, its tensors under the names the engine
maps them to), fed by the verifier on the CPU (or a GPU where there is one). It catches by numbers what names and
shapes cannot show: a random draft, a square weight stored transposed, features from other layers.

No tokenizer is needed: the prompt is token ids (`--prompt-ids`), the text of `--prompt` where the verifier has a
tokenizer, else the verifier's BOS token alone; the verifier's greedy continuation is what the draft must predict.

The floor. The decode counts, over its verifier passes (16 to 64: 64 new tokens at depth 3), how often the verifier
accepted the draft's first proposal. A draft that does not predict the verifier at all (random weights, features of
other layers) is right about as often as chance, 1 in the draft vocabulary: next to never. A trained EAGLE-3 draft
served in production accepts 3-6 tokens per pass (the EAGLE-3 paper), a first-position rate of 0.7-0.85; longrun's
tiny test drafts reach 0.83-1.0. A draft read wrongly in one weight does not always fall to chance: in the tiny test
setup (tests/trainer/test_check_draft.py) a square o_proj stored transposed, or zeroed, still gets 0.40-0.46, since fc
and the MLP carry much of the prediction. The floor is a first-position rate of 0.5: a draft under it adds at most
1 / (1 - 0.5) = 2 tokens per pass at any depth, under what a working EAGLE-3 draft gives, and a draft of a true 0.75
falls under it in 20 passes with a probability of 0.4 % (binomial). An early checkpoint may lie under it and still be
read right: `--acceptance-floor` lowers it, and the figures are in the answer either way.
"""

import json
from pathlib import Path

ACCEPTANCE_FLOOR = 0.5
SMOKE_DEPTH = 3
SMOKE_NEW_TOKENS = 64  # at least 16 passes at depth 3
QKV = ("q_proj", "k_proj", "v_proj")


def engine_draft_config(config: dict, capture: list[int]) -> dict:
    """longrun's DraftConfig fields for the draft as the engine builds it from `config` (an engine-format Llama
    config): the engine's defaults where the config says nothing, the layers the engine captures, its RoPE."""
    from longrun.draft_rules import rope_of  # noqa: PLC0415

    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    theta, _ = rope_of(config)
    scaling = config.get("rope_scaling") or None
    params = config.get("rope_parameters") or {}
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return {
        "hidden_size": hidden, "intermediate_size": config["intermediate_size"], "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads, "rms_norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": theta, "rope_scaling": scaling, "vocab_size": config["vocab_size"],
        "draft_vocab_size": config.get("draft_vocab_size") or config["vocab_size"],
        "target_hidden_size": config.get("target_hidden_size") or hidden, "aux_hidden_state_layer_ids": list(capture),
        "max_position_embeddings": config.get("max_position_embeddings", 8192),
        "fc_norm": bool(config.get("fc_norm")), "norm_output": bool(config.get("norm_output")),
    }


def load_engine_draft(directory: Path, capture: list[int], embed_weight):
    """longrun's EagleDraft holding the export's weights under the names an engine maps them to (`model.` dropped,
    `layers.0.` as `midlayer.`, q/k/v split at the token / feature boundary of the 2H input)."""
    import torch  # noqa: PLC0415
    from safetensors.torch import load_file  # noqa: PLC0415

    from trainer.model import DraftConfig, EagleDraft, identity_vocab_mapping  # noqa: PLC0415

    config = DraftConfig(**engine_draft_config(json.loads((directory / "config.json").read_text()), capture))
    draft = EagleDraft(config, embed_weight)
    state = {}
    for name, tensor in load_file(str(directory / "model.safetensors")).items():
        name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        if name != "embed_tokens.weight":
            state[name] = tensor
    weights = [state.pop(f"midlayer.self_attn.{name}.weight") for name in QKV]
    h = config.hidden_size
    state["midlayer.self_attn.qkv_token.weight"] = torch.cat([w[:, :h] for w in weights])
    state["midlayer.self_attn.qkv_hidden.weight"] = torch.cat([w[:, h:] for w in weights])
    for name, tensor in identity_vocab_mapping(config).items():  # no d2t: the engines take draft id i as target id i
        state.setdefault(name, tensor)
    own = draft.state_dict()
    draft.load_state_dict({name: tensor.to(own[name].dtype) for name, tensor in state.items()}, strict=True)
    return draft


def prompt_ids(verifier: Path, prompt: str | None, ids: list[int] | None) -> tuple[list[int], str]:
    """The decode's prompt as token ids, and how they were found."""
    if ids:
        return ids, "--prompt-ids"
    if prompt:
        from transformers import AutoTokenizer  # noqa: PLC0415

        try:
            return AutoTokenizer.from_pretrained(str(verifier))(prompt)["input_ids"], "--prompt, tokenized"
        except (OSError, ValueError, TypeError, KeyError):
            pass  # no tokenizer: token ids are enough
    config = json.loads((verifier / "config.json").read_text())
    bos = config.get("bos_token_id", (config.get("text_config") or {}).get("bos_token_id"))
    return [bos if isinstance(bos, int) else 0], "the verifier's BOS token (no tokenizer)"


def smoke_decode(directory: Path, verifier: Path, capture: list[int], prompt: str | None = None,
                 ids: list[int] | None = None, floor: float = ACCEPTANCE_FLOOR, depth: int = SMOKE_DEPTH,
                 new_tokens: int = SMOKE_NEW_TOKENS) -> dict:
    """One greedy speculative decode with the draft fed the layers the engine captures: the tokens accepted per
    verifier pass, the first proposal's acceptance rate and whether it clears `floor`. Loads torch,
    transformers and the trainer here, not at import."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    from trainer.evaluate import DecodeStats, DraftProposer, Verifier, speculative_decode  # noqa: PLC0415

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    major_minor = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    dtype_arg = "dtype" if major_minor >= (4, 56) else "torch_dtype"  # as trainer/verifier_model.py load_verifier
    model = transformers.AutoModelForCausalLM.from_pretrained(str(verifier), **{dtype_arg: dtype})
    model = model.to(device).eval()
    draft = load_engine_draft(directory, capture, model.get_input_embeddings().weight.detach()).to(device).eval()
    tokens, how = prompt_ids(verifier, prompt, ids)
    stats = DecodeStats()
    out = speculative_decode(Verifier(model, capture), DraftProposer(draft), tokens, depth, new_tokens, None, stats)
    first = stats.position_acceptance(depth)[0] if stats.passes else 0.0
    return {"prompt": how, "prompt_tokens": len(tokens), "new_tokens": len(out), "passes": stats.passes,
            "mean_accepted": round(stats.mean_accepted(depth), 3), "depth": depth,
            "first_acceptance": round(first, 3), "floor": floor, "passed": first >= floor}
