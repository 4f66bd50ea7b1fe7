"""The EAGLE-3 draft model: one Llama-style decoder layer over fused verifier features.

Read top to bottom: the config, the building blocks (RMSNorm, RoPE, MLP), the attention of one
TTT step, the decoder layer, the draft itself, and saving/loading in the format that inference
engines (vLLM, SGLang: `LlamaForCausalLMEagle3`) load, and in speculators' own format.

EAGLE 3.1 (two options, off by default), as speculators 0.9.0 writes it, src/speculators/models/eagle3/core.py
and config.py (`Eagle3DraftModel.forward`, `Eagle3SpeculatorConfig`; at c05b95b of its main branch its
trainer turns `norm_output` on by default for eagle3, src/speculators/train/config/schema.py):
- `fc_norm`: one RMSNorm per captured feature before the fusing fc, `fc(cat(norm_a(h_a), norm_b(h_b), norm_c(h_c)))`,
  weights `fc_norm.{i}.weight`;
- `norm_output`: the hidden state handed to the next TTT step (and the next drafted token) is the final norm's
  output, and the lm_head reads it as is, instead of the pre-norm hidden state.

The attention input is `[norm(embedding of the token), norm(hidden)]` (2H wide). Its q/k/v
projection is kept as two halves, `qkv_token` and `qkv_hidden`, whose sum equals the projection
of the concatenation; the token half at TTT step k and position t is the one step 0 computed at
position t+k, so training computes it once per batch. The engine format (`q_proj`, `k_proj`,
`v_proj` over the concatenation) is produced on save and read back on load.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from trainer.attention import ttt_attention
from trainer.compiled import compiled
from trainer.verifier_model import default_layer_ids

# model_type -> (heads, KV heads, head_dim) of the draft served for that verifier family
FAMILY_DRAFT_ATTENTION = {"deepseek_v3": (56, 8, 128), "kimi_k2": (56, 8, 128)}


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the verifier's (target) vocabulary
    draft_vocab_size: int
    target_hidden_size: int  # width of one captured verifier feature; fc takes three of them
    aux_hidden_state_layer_ids: list[int]
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    ttt_steps: int = 1
    fc_norm: bool = False  # EAGLE 3.1: an RMSNorm per captured feature before fc
    norm_output: bool = False  # EAGLE 3.1: the next step reads the final norm's output

    @classmethod
    def from_verifier(cls, verifier: dict, draft_vocab_size: int, ttt_steps: int, num_heads: int | None = None,
                      num_kv_heads: int | None = None, head_dim: int | None = None, fc_norm: bool = False,
                      norm_output: bool = False) -> "DraftConfig":
        """Draft shapes from a verifier's config.json (already unwrapped from any `text_config`).

        The attention shape is the verifier's, except for the DeepSeek-V3 / Kimi-K2 family (multi-head latent
        attention, which a Llama-style draft cannot copy): there the draft the engines are served with is 56 heads,
        8 KV heads of 128 (SpecForge's configs/deepseek-v3-671b-eagle3.json @ a6b6b02). `num_heads`,
        `num_kv_heads`, `head_dim` override either."""
        hidden = verifier["hidden_size"]
        layers = verifier["num_hidden_layers"]
        family = FAMILY_DRAFT_ATTENTION.get(verifier.get("model_type", ""))
        if family:
            heads, kv_heads, dim = family
        else:
            heads = verifier["num_attention_heads"]
            kv_heads, dim = verifier.get("num_key_value_heads") or heads, verifier.get("head_dim") or hidden // heads
        heads, kv_heads, dim = num_heads or heads, num_kv_heads or kv_heads, head_dim or dim
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads cannot share {kv_heads} KV heads evenly")
        rope = verifier.get("rope_parameters") or {}
        scaling = verifier.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("linear", "llama3", "yarn"):
            scaling = None  # the draft has its own RoPE; unknown scalings fall back to plain RoPE
        if scaling:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        return cls(
            hidden_size=hidden,
            intermediate_size=verifier["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=dim,
            rms_norm_eps=verifier.get("rms_norm_eps", 1e-6),
            rope_theta=verifier.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=verifier.get("max_position_embeddings", 8192),
            vocab_size=verifier["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            aux_hidden_state_layer_ids=default_layer_ids(layers),
            ttt_steps=ttt_steps,
            fc_norm=fc_norm,
            norm_output=norm_output,
        )

    def to_engine_config(self) -> dict:
        """config.json that vLLM / SGLang load as an EAGLE-3 draft, plus this class's own fields.

        `aux_hidden_state_layer_ids` are inputs of layers (longrun's convention). The engines name the
        same capture points differently, so each gets its own key:
        - vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` and captures the input of each layer;
        - SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as outputs of layers and captures the
          input of layer id + 1, so it is given the ids minus one.
        """
        layer_ids = list(self.aux_hidden_state_layer_ids)
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            **asdict(self),
            "rope_scaling": engine_rope_scaling(self),
            "eagle_aux_hidden_state_layer_ids": layer_ids,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in layer_ids],
                "use_aux_hidden_state": True,
            },
        }

    @classmethod
    def from_engine_config(cls, config: dict) -> "DraftConfig":
        """This class's fields from a config.json; a draft written by another trainer gets its capture
        layers from the engines' keys (vLLM's top-level input-of-layer ids, else SGLang's output-of-layer ids)."""
        names = cls.__dataclass_fields__
        fields = {k: v for k, v in config.items() if k in names}
        if "aux_hidden_state_layer_ids" not in fields:
            eagle_config = config.get("eagle_config") or {}
            if config.get("eagle_aux_hidden_state_layer_ids"):
                fields["aux_hidden_state_layer_ids"] = list(config["eagle_aux_hidden_state_layer_ids"])
            elif eagle_config.get("eagle_aux_hidden_state_layer_ids"):
                fields["aux_hidden_state_layer_ids"] = [i + 1 for i in eagle_config["eagle_aux_hidden_state_layer_ids"]]
        return cls(**fields)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


rms_norm = compiled(_rms_norm)


def rope_inverse_frequencies(config: DraftConfig) -> Tensor:
    """The draft's RoPE frequencies: plain, linear, llama3 or YaRN scaled as the verifier's config says (YaRN as
    transformers' `_compute_yarn_parameters`, the one a DeepSeek-V3 verifier runs)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv_freq = _yarn_inverse_frequencies(config, scaling)
    return inv_freq.float()


def _yarn_inverse_frequencies(config: DraftConfig, scaling: dict) -> Tensor:
    d, base = config.head_dim, config.rope_theta
    factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]
    original = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    extrapolation = 1 - ramp
    return (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation


def engine_rope_scaling(config: DraftConfig) -> dict | None:
    """`rope_scaling` as the engines must read it to apply the draft's own RoPE. vLLM's `get_rope` (and SGLang's
    copy of it) builds a Llama draft's YaRN from `factor`, `original_max_position_embeddings`, `beta_fast`,
    `beta_slow`, `extrapolation_factor`, `attn_factor` only, and scales cos/sin by (0.1 ln(factor) + 1) x attn_factor
    (vllm/model_executor/layers/rotary_embedding/__init__.py @ 07b12f1, yarn_scaling_rope.py): DeepSeek's
    mscale / mscale_all_dim (a factor of 1 for DeepSeek-V3) are dropped. `attn_factor` is set so that their product
    is the factor the draft trained with; transformers and longrun read `attention_factor` or the mscales, not it."""
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn":
        factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]
        engine = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        trained = rope_attention_factor(config)
        if abs(trained - engine) > 1e-9:
            scaling["attn_factor"] = trained / engine
    return scaling


def rope_attention_factor(config: DraftConfig) -> float:
    """The factor on cos/sin: 1 but for YaRN (its `attention_factor`, else mscale / mscale_all_dim, else
    0.1 ln(factor) + 1, as transformers)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
    return mscale()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, Q, heads, d]; cos/sin [Q, d] (or [B, Q, d]: packed rows) for the positions of those Q rows."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class TTTCache:
    """What a TTT chain has produced so far: step 0's keys/values at every position, then one
    diagonal key/value per later step (each at the same positions as the queries). `documents`: per
    row, the lengths of the samples packed in it (None: one sample per row)."""

    keys: Tensor | None = None
    values: Tensor | None = None
    diag_keys: list[Tensor] = field(default_factory=list)
    diag_values: list[Tensor] = field(default_factory=list)
    documents: tuple[tuple[int, ...], ...] | None = None


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.qkv_sizes = [self.heads * d, self.kv_heads * d, self.kv_heads * d]
        self.qkv_token = nn.Linear(h, sum(self.qkv_sizes), bias=False)
        self.qkv_hidden = nn.Linear(h, sum(self.qkv_sizes), bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.scale = d**-0.5

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: TTTCache) -> Tensor:
        """The TTT attention of this step's q [B, Q, heads, d] (RoPE applied) after its k/v join `cache`;
        returns [B, Q, heads, d] (before o_proj)."""
        if cache.keys is None:
            cache.keys, cache.values = k, v
        else:
            cache.diag_keys.append(k)
            cache.diag_values.append(v)
        return ttt_attention(q, cache.keys, cache.values, cache.diag_keys, cache.diag_values, self.scale, cache.documents)


class DraftDecoderLayer(nn.Module):
    """One TTT step runs as two functions around the attention: `attention_inputs` (hidden norm, the hidden
    half of q/k/v plus the token half, RoPE) and `attention_output_and_mlp` (o_proj, residual, norm, SwiGLU
    MLP, residual). While training on a GPU each is one compiled region, so a step is a handful of kernels
    and host calls rather than a hundred (at 2048 positions the host's launches, not the GPU, set the pace)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)  # normalises the token embedding
        self.hidden_norm = RMSNorm(config.hidden_size, eps)  # normalises the hidden input
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = DraftMLP(config.hidden_size, config.intermediate_size)

    def step_weights(self) -> tuple[Tensor, ...]:
        """The weights a step multiplies by. While training under autocast they are cast once here, to the
        autocast dtype: a TTT chain takes them once and passes them to each of its steps, so the compiled
        regions neither cast per step nor hand back a full-precision gradient per step (what autocast's own
        cache does for eager modules). Elsewhere (no grad: validation, decoding) autocast casts as usual."""
        attn, mlp = self.self_attn, self.mlp
        weights = (attn.qkv_hidden.weight, attn.o_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                   mlp.down_proj.weight)
        device = weights[0].device.type
        if torch.is_grad_enabled() and torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            weights = tuple(w.to(dtype) for w in weights)
        return (self.hidden_norm.weight, self.post_attention_layernorm.weight, *weights)

    def forward(self, hidden: Tensor, token_qkv: Tensor, cos: Tensor, sin: Tensor, cache: TTTCache,
                weights: tuple[Tensor, ...] | None = None) -> Tensor:
        hidden_norm, post_norm, qkv_w, o_w, gate_w, up_w, down_w = weights or self.step_weights()
        attn, eps = self.self_attn, self.hidden_norm.eps
        q, k, v = attention_inputs(hidden, token_qkv, cos, sin, hidden_norm, qkv_w, eps, attn.qkv_sizes,
                                   attn.heads, attn.kv_heads, attn.head_dim)
        out = attn.attend(q, k, v, cache)
        return attention_output_and_mlp(hidden, out, o_w, post_norm, gate_w, up_w, down_w, eps)


@compiled
def attention_inputs(hidden: Tensor, token_qkv: Tensor, cos: Tensor, sin: Tensor, norm_weight: Tensor,
                     qkv_weight: Tensor, eps: float, sizes: list[int], heads: int, kv_heads: int, head_dim: int):
    """(q, k, v) [B, Q, heads or kv_heads, d] of a step: the token half `token_qkv` plus the projection of the
    normed hidden input, RoPE on q and k."""
    b, nq, _ = hidden.shape
    qkv = token_qkv + F.linear(_rms_norm(hidden, norm_weight, eps), qkv_weight)
    q, k, v = qkv.split(sizes, dim=-1)
    q = apply_rotary(q.reshape(b, nq, heads, head_dim), cos, sin)
    k = apply_rotary(k.reshape(b, nq, kv_heads, head_dim), cos, sin)
    return q, k, v.reshape(b, nq, kv_heads, head_dim)


@compiled
def attention_output_and_mlp(hidden: Tensor, attention: Tensor, o_weight: Tensor, norm_weight: Tensor,
                             gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor, eps: float) -> Tensor:
    """The step's output hidden state from its input and its attention [B, Q, heads, d]."""
    b, nq = attention.shape[:2]
    hidden = hidden + F.linear(attention.reshape(b, nq, -1), o_weight)
    x = _rms_norm(hidden, norm_weight, eps)
    return hidden + F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


class EagleDraft(nn.Module):
    """fc (3H -> H), one decoder layer, final norm, lm_head (H -> draft vocab).

    The token embedding is the verifier's, frozen, and kept out of the state dict; `d2t`
    (draft id -> target id offsets) and `t2d` (target ids present in the draft vocab) travel with it, except
    where they are the identity mapping of a draft of the full vocabulary (`engine_state_dict`).
    """

    def __init__(self, config: DraftConfig, embed_weight: Tensor | None = None):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps) for _ in range(3))
        self.midlayer = DraftDecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if embed_weight is None:
            embed_weight = torch.zeros(config.vocab_size, h)
        self.register_buffer("embed_weight", embed_weight, persistent=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.rope_factor = rope_attention_factor(config)

    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fuse(self, hidden_states: Tensor) -> Tensor:
        """The three captured verifier features [B, S, 3H] fused to the draft's width."""
        if self.config.fc_norm:
            chunks = hidden_states.chunk(3, dim=-1)
            hidden_states = torch.cat([norm(x) for norm, x in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(hidden_states)

    def token_qkv(self, token_ids: Tensor) -> Tensor:
        """The token half of the q/k/v projection for token ids [B, L]."""
        layer = self.midlayer
        embedded = F.embedding(token_ids, self.embed_weight)
        return layer.self_attn.qkv_token(layer.input_layernorm(embedded))

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.rope_factor != 1.0:
            return emb.cos() * self.rope_factor, emb.sin() * self.rope_factor
        return emb.cos(), emb.sin()

    def step(self, cache: TTTCache, hidden: Tensor, token_qkv: Tensor, cos: Tensor, sin: Tensor,
             weights: tuple[Tensor, ...] | None = None) -> Tensor:
        """One TTT step. `hidden` [B, Q, H] is the fused verifier features at step 0 and the previous
        step's output after that; `token_qkv` [B, Q, n_qkv] the token half for the tokens these
        positions read; cos/sin the RoPE of their positions; `weights` the layer's `step_weights()`, taken
        once per chain (each step takes them itself without). Returns the step's output hidden state (with
        `norm_output`, after the final norm: what the next step and `logits` read)."""
        out = self.midlayer(hidden, token_qkv, cos, sin, cache, weights)
        return self.norm(out) if self.config.norm_output else out

    def step_weights(self) -> tuple[Tensor, ...]:
        return self.midlayer.step_weights()

    def logits(self, hidden: Tensor) -> Tensor:
        """The draft-vocabulary logits of a step's output (`step` already applied the final norm with `norm_output`)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))


_QKV = ("q_proj", "k_proj", "v_proj")


def identity_vocab_mapping(config: DraftConfig) -> dict[str, Tensor]:
    """`d2t` and `t2d` of a draft of the full vocabulary: draft id i is target id i."""
    return {"d2t": torch.zeros(config.draft_vocab_size, dtype=torch.long),
            "t2d": torch.ones(config.vocab_size, dtype=torch.bool)}


def is_identity_mapping(draft: EagleDraft) -> bool:
    return draft.config.draft_vocab_size == draft.config.vocab_size and not bool(draft.d2t.any())


def engine_state_dict(draft: EagleDraft) -> dict[str, Tensor]:
    """The draft's weights under the names inference engines load (q/k/v over the 2H input). A draft of the full
    vocabulary mapped to itself carries no `d2t` / `t2d`, as the engines build it: vLLM 0.30.0's
    llama_eagle3.py Eagle3LlamaForCausalLM.__init__ has no draft_id_to_target_id where the draft's vocabulary is
    the target's, and its AutoWeightsLoader stops at a `d2t` there (longrun/draft_releases.py); speculators
    0.9.0's model.py DraftVocabMixin._init_vocab registers both as None then."""
    attn = draft.midlayer.self_attn
    skip = ("d2t", "t2d") if is_identity_mapping(draft) else ()
    state = {k: v for k, v in draft.state_dict().items()
             if not k.startswith("midlayer.self_attn.qkv_") and k not in skip}
    token = attn.qkv_token.weight.detach().split(attn.qkv_sizes, dim=0)
    hidden = attn.qkv_hidden.weight.detach().split(attn.qkv_sizes, dim=0)
    for name, t, h in zip(_QKV, token, hidden, strict=True):
        state[f"midlayer.self_attn.{name}.weight"] = torch.cat((t, h), dim=1)
    return state


def _from_engine_state_dict(state: dict[str, Tensor], hidden_size: int) -> dict[str, Tensor]:
    state = dict(state)
    weights = [state.pop(f"midlayer.self_attn.{name}.weight") for name in _QKV]
    state["midlayer.self_attn.qkv_token.weight"] = torch.cat([w[:, :hidden_size] for w in weights])
    state["midlayer.self_attn.qkv_hidden.weight"] = torch.cat([w[:, hidden_size:] for w in weights])
    return state


def _write(directory: str | Path, state: dict[str, Tensor], config: dict, dtype: torch.dtype | None) -> None:
    """model.safetensors (floating tensors cast to `dtype`) + config.json in `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cast = {name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
            for name, t in state.items()}
    save_file(cast, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_draft(draft: EagleDraft, directory: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write model.safetensors + config.json (engine-loadable). `dtype` casts floating tensors."""
    config = draft.config.to_engine_config()
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    _write(directory, engine_state_dict(draft), config, dtype)


def read_draft_config(directory: str | Path) -> DraftConfig:
    return DraftConfig.from_engine_config(json.loads((Path(directory) / "config.json").read_text()))


def load_draft_weights(draft: EagleDraft, directory: str | Path) -> None:
    """Load weights (and the vocab mapping) saved by `save_draft` into an existing draft; a draft of the full
    vocabulary without `d2t` / `t2d` maps each draft id to itself."""
    state = load_file(str(Path(directory) / "model.safetensors"))
    state = _from_engine_state_dict(state, draft.config.hidden_size)
    state.pop("embed_tokens.weight", None)  # some published drafts carry a copy of the embedding
    if draft.config.draft_vocab_size == draft.config.vocab_size:
        for name, tensor in identity_vocab_mapping(draft.config).items():
            state.setdefault(name, tensor)
    own = draft.state_dict()
    unexpected = sorted(set(state) - set(own))
    missing = sorted(set(own) - set(state))
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match the draft (missing {missing}, unexpected {unexpected})")
    for name, tensor in state.items():
        if own[name].shape != tensor.shape:
            raise ValueError(f"{directory}: {name} has shape {tuple(tensor.shape)}, this draft needs {tuple(own[name].shape)}")
    draft.load_state_dict({name: tensor.to(own[name].dtype) for name, tensor in state.items()})


def load_draft(directory: str | Path, embed_weight: Tensor | None = None) -> EagleDraft:
    """A draft rebuilt from a directory written by `save_draft`; the embedding comes from the verifier."""
    draft = EagleDraft(read_draft_config(directory), embed_weight)
    load_draft_weights(draft, directory)
    return draft


SPECULATORS_DIR = "speculators"  # the speculators-format export, beside the engine export
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes


def speculators_config(config: DraftConfig, verifier_path: str | Path | None = None, dtype: str = "bfloat16") -> dict:
    """config.json in speculators' own format, as speculators 0.9.0 `Eagle3SpeculatorConfig.to_dict` writes it
    (src/speculators/models/eagle3/config.py, src/speculators/config.py): the capture layers as
    `eagle_aux_hidden_state_layer_ids` (inputs of layers, longrun's convention), the decoder layer as a Llama
    `transformer_layer_config`. `norm_before_residual` is written as false: vLLM's reader of this format
    (vllm/transformers_utils/configs/speculators/algos.py @ cfb173a) takes it as true when absent."""
    verifier_architectures = ["LlamaForCausalLM"]
    if verifier_path is not None and (Path(verifier_path) / "config.json").is_file():
        verifier_architectures = json.loads((Path(verifier_path) / "config.json").read_text()).get(
            "architectures") or verifier_architectures
    rope = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling:
        kind = config.rope_scaling.get("rope_type", config.rope_scaling.get("type", "default"))
        scaling = engine_rope_scaling(config) or {}
        rope.update({k: v for k, v in scaling.items() if k not in ("type", "rope_type")}, rope_type=kind)
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, "rope_parameters": rope,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "dtype": dtype,
    }
    return {
        "architectures": ["Eagle3DraftModel"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_hidden_state_layer_ids),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.ttt_steps,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": str(verifier_path) if verifier_path is not None else None,
                         "architectures": verifier_architectures},
        },
    }


def speculators_state_dict(draft: EagleDraft) -> dict[str, Tensor]:
    """The engine weights under speculators' names (the decoder layer is `layers.0.*` instead of `midlayer.*`), and
    the verifier's token embedding as `embed_tokens.weight`, as speculators' own `save_pretrained` writes: without
    it, speculators 0.9.0 `SpeculatorModel.from_pretrained` keeps uninitialised memory for the embedding (its
    `_load_verifier_weights` loads the verifier's only where the weight is NaN, src/speculators/model.py)."""
    state = {name.replace("midlayer.", "layers.0.", 1): t for name, t in engine_state_dict(draft).items()}
    state["embed_tokens.weight"] = draft.embed_weight
    return state


def save_speculators_draft(draft: EagleDraft, directory: str | Path, dtype: torch.dtype | None = None,
                           verifier_path: str | Path | None = None) -> None:
    """Write model.safetensors + config.json that speculators' `SpeculatorModel.from_pretrained` loads (the
    verifier's norm and lm_head come from `verifier_path` when it loads)."""
    config = speculators_config(draft.config, verifier_path, str(dtype or draft.fc.weight.dtype).removeprefix("torch."))
    _write(directory, speculators_state_dict(draft), config, dtype)
