"""The verifier's cost, read from its own config.json: what one forward over n tokens reads and computes on each GPU
of the serving group, and which collectives each layer issues under the engine's parallelism.

Plain arithmetic over the config, no torch. What it reads (Hugging Face names; a multimodal wrapper's
`text_config` / `language_config` is unwrapped):

- shape: num_hidden_layers, hidden_size, vocab_size, num_attention_heads, num_key_value_heads, head_dim,
  intermediate_size, tie_word_embeddings;
- attention: MLA where kv_lora_rank is set (DeepSeek-V3 / Kimi-K2: q_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
  v_head_dim; the cache holds kv_lora_rank + qk_rope_head_dim values per token and layer, replicated on every
  tensor-parallel rank), else GQA (2 x num_key_value_heads x head_dim per token and layer, split over at most
  num_key_value_heads ranks);
- experts: n_routed_experts (DeepSeek/Kimi), num_local_experts (Mixtral) or num_experts (Qwen-MoE);
  num_experts_per_tok; n_shared_experts (x moe_intermediate_size) or shared_expert_intermediate_size (Qwen);
  moe_intermediate_size (else intermediate_size); first_k_dense_replace dense layers first (DeepSeek/Kimi),
  mlp_only_layers / decoder_sparse_step (Qwen);
- weight bits: quantization_config's quant_method: fp8 (8), compressed-tensors (config_groups' num_bits, plus a
  bf16 scale per group_size weights), awq / gptq (bits or w_bit, group scales likewise), bitsandbytes 4-bit;
  without one, torch_dtype. Modules its `ignore` / `modules_to_not_convert` names (attention, shared experts,
  dense MLPs, lm_head) stay at 16 bits.

One forward over n tokens at batch 1, on each of `tp` GPUs (decode at batch 1 reads weights, it does not compute):

    forward_ms(n) = fixed_bytes / (tp x HBM)                       attention, dense MLPs, shared experts, lm_head
                  + expert_bytes x (1 - (1 - k/E)^n) / (tp x HBM)  the routed experts the n tokens touch (expected)
                  + kv_bytes_per_gpu x context / HBM               the KV cache read by attention
                  + 2 x active_params x n / (tp x FLOPS)

Under expert parallelism each GPU holds E/ep whole experts instead of a 1/tp slice of each: the mean bytes per GPU
are the same (routing imbalance is not modelled); the collectives differ. Each layer issues, per forward:

- tensor parallelism (ep = 1): 2 all-reduces of n x hidden x 2 bytes (after attention, after the MLP or MoE);
- expert parallelism (ep = tp): 1 all-reduce (attention) and, in an MoE layer, an all-to-all dispatch and an
  all-to-all combine of n x k x hidden x 2 bytes; a dense layer keeps its 2 all-reduces. No all-to-all table is
  measured: each is priced as one all-reduce call of the same bytes from the host's table (modelled).

`longrun hosts probe-verifier HOST --config PATH --tp N [--ep E]` times one dense and one MoE layer of this shape on
the host's GPU at 1..16 tokens (worker/verifier_probe.py, read back by read_probe); stored beside the host's
all-reduce table, those times replace the modelled layers at the tp and ep they were timed at (`measured`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from server.advisor.tables import DEFAULT_HBM_BYTES_PER_S, DEFAULT_KV_CONTEXT_TOKENS, DEFAULT_TFLOPS

MAX_CONFIG_BYTES = 1 << 20
# decode activations and the KV cache: bf16
ACTIVATION_BYTES = 2
BUILT_IN = ("built-in default: a 70B-class dense verifier in bf16 (Llama-3-70B shapes: 80 layers, hidden 8192), "
            "not the run's own")


def _int(config: dict, *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return default


def _need(config: dict, *names: str) -> int:
    value = _int(config, *names)
    if not value:
        raise ValueError(f"config.json has no {' / '.join(names)} (a whole number > 0)")
    return value


@dataclass(frozen=True)
class WeightBits:
    """Bits per weight read: the routed experts' and every other matrix's (modules a scheme leaves unquantized)."""

    experts: float
    attention: float
    dense_mlp: float
    shared: float
    lm_head: float
    scheme: str


_DTYPE_BITS = {"bfloat16": 16, "float16": 16, "half": 16, "float32": 32, "float": 32, "float8_e4m3fn": 8,
               "float8_e5m2": 8}


def _weight_bits(config: dict) -> WeightBits:
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")
    plain = _DTYPE_BITS.get(dtype, 16)
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return WeightBits(plain, plain, plain, plain, plain, f"{dtype} ({plain} bits)")
    method = str(qc.get("quant_method") or qc.get("quant_type") or "").lower()
    group = None
    if method == "fp8":
        bits = 8.0
        scheme = "fp8"
    elif method == "compressed-tensors":
        weights = next((g.get("weights") for g in (qc.get("config_groups") or {}).values()
                        if isinstance(g, dict) and isinstance(g.get("weights"), dict)), None) or {}
        bits = weights.get("num_bits")
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 32:
            raise ValueError("quantization_config (compressed-tensors) has no config_groups.*.weights.num_bits")
        group = weights.get("group_size")
        kind = weights.get("type") or "int"
        scheme = f"compressed-tensors {kind}{bits}" + (f", group size {group}" if group else "")
    elif method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        bits = qc.get("bits") or qc.get("w_bit")
        if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 32:
            raise ValueError(f"quantization_config ({method}) has no bits")
        group = qc.get("group_size") or qc.get("q_group_size")
        scheme = f"{method} int{bits}" + (f", group size {group}" if group and group > 0 else "")
    elif method == "bitsandbytes":
        bits = 4 if qc.get("load_in_4bit") else 8
        scheme = f"bitsandbytes {bits}-bit"
    else:
        raise ValueError(f"quantization_config's quant_method {method or '(none)'!r} is not one the advisor reads "
                         "(fp8, compressed-tensors, awq, gptq, bitsandbytes)")
    effective = float(bits)
    if isinstance(group, int) and not isinstance(group, bool) and group > 0:
        effective += 16 / group  # a bf16 scale per group of weights
    ignored = [str(x).lower() for x in (qc.get("ignore") or qc.get("modules_to_not_convert")
                                         or qc.get("ignored_layers") or []) if isinstance(x, str)]

    def at(*words: str, unless: str | None = None) -> float:
        hit = any(any(w in entry for w in words) and not (unless and unless in entry) for entry in ignored)
        return plain if hit else effective

    return WeightBits(experts=effective, attention=at("attn"), dense_mlp=at("mlp", unless="expert"),
                      shared=at("shared_expert"), lm_head=at("lm_head"),
                      scheme=f"{scheme}: {effective:g} bits per routed-expert weight")


@dataclass(frozen=True)
class VerifierShape:
    """The verifier as the cost model needs it, from its config.json."""

    name: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    attention: str  # "gqa" or "mla"
    kv_heads: int
    head_dim: int
    intermediate: int
    dense_layers: int
    moe_layers: int
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts together
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    tied_embeddings: bool = False
    model_type: str = ""  # config.json's (its text_config's) model_type: what an engine checks a target by
    architecture: str = ""  # config.json's first `architectures` (the outer one): the class vLLM builds
    bits: WeightBits = field(default_factory=lambda: WeightBits(16, 16, 16, 16, 16, "bfloat16 (16 bits)"))

    @classmethod
    def from_config(cls, config: dict, name: str = "verifier") -> VerifierShape:
        if not isinstance(config, dict):
            raise ValueError("config.json is not a JSON object")
        architectures = config.get("architectures")
        architecture = architectures[0] if isinstance(architectures, list) and architectures else ""
        text = config.get("text_config") or config.get("language_config")
        if isinstance(text, dict):
            config = {**config, **text}
        layers, hidden = _need(config, "num_hidden_layers", "n_layer"), _need(config, "hidden_size", "n_embd")
        heads = _need(config, "num_attention_heads", "n_head")
        kv_heads = _int(config, "num_key_value_heads", default=heads) or heads
        head_dim = _int(config, "head_dim", default=hidden // heads) or hidden // heads
        experts = _int(config, "n_routed_experts", "num_local_experts", "num_experts", default=0) or 0
        k = _int(config, "num_experts_per_tok", "moe_topk", default=0) or 0
        intermediate = _int(config, "intermediate_size", default=4 * hidden) or 4 * hidden
        fields_: dict[str, Any] = {}
        if experts:
            if not 1 <= k <= experts:
                raise ValueError(f"config.json names {experts} experts but num_experts_per_tok {k!r}")
            expert_intermediate = _int(config, "moe_intermediate_size", default=intermediate) or intermediate
            shared = (_int(config, "n_shared_experts", default=0) or 0) * expert_intermediate or (
                _int(config, "shared_expert_intermediate_size", default=0) or 0)
            dense = {i for i in range(layers) if i < (_int(config, "first_k_dense_replace", default=0) or 0)}
            dense |= {i for i in config.get("mlp_only_layers") or [] if isinstance(i, int) and 0 <= i < layers}
            step = _int(config, "decoder_sparse_step", "moe_layer_freq", default=1) or 1
            dense |= {i for i in range(layers) if (i + 1) % step}
            fields_ |= {"experts": experts, "experts_per_token": k, "expert_intermediate": expert_intermediate,
                        "shared_intermediate": shared}
            dense_layers = len(dense)
        else:
            dense_layers = layers
        if _int(config, "kv_lora_rank"):
            attention = "mla"
            fields_ |= {"q_lora_rank": _int(config, "q_lora_rank", default=0) or 0,
                        "kv_lora_rank": _need(config, "kv_lora_rank"),
                        "qk_nope_head_dim": _int(config, "qk_nope_head_dim", default=head_dim) or head_dim,
                        "qk_rope_head_dim": _need(config, "qk_rope_head_dim"),
                        "v_head_dim": _int(config, "v_head_dim", default=head_dim) or head_dim}
        else:
            attention = "gqa"
        return cls(name=name, layers=layers, hidden=hidden, vocab=_need(config, "vocab_size"), heads=heads,
                   attention=attention, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
                   dense_layers=dense_layers, moe_layers=layers - dense_layers,
                   tied_embeddings=bool(config.get("tie_word_embeddings")), bits=_weight_bits(config),
                   model_type=str(config.get("model_type") or "")[:64], architecture=str(architecture)[:64],
                   **fields_)

    # parameters, per layer and in all

    @property
    def attention_params(self) -> int:
        h, n = self.hidden, self.heads
        if self.attention == "mla":
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank else h * n * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (
                self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + n * self.v_head_dim * h
        return h * n * self.head_dim + 2 * h * self.kv_heads * self.head_dim + n * self.head_dim * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def moe_layer_fixed_params(self) -> int:
        """An MoE layer's weights every token reads: the shared experts and the router."""
        return 3 * self.hidden * self.shared_intermediate + self.hidden * self.experts

    @property
    def total_params(self) -> int:
        per_moe = self.experts * self.expert_params + self.moe_layer_fixed_params
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return (self.layers * self.attention_params + self.dense_layers * 3 * self.hidden * self.intermediate
                + self.moe_layers * per_moe + embeddings)

    @property
    def active_params(self) -> int:
        """Weights one token computes with (the embedding row aside)."""
        per_moe = self.experts_per_token * self.expert_params + self.moe_layer_fixed_params
        return (self.layers * self.attention_params + self.dense_layers * 3 * self.hidden * self.intermediate
                + self.moe_layers * per_moe + self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        per_layer = (self.kv_lora_rank + self.qk_rope_head_dim if self.attention == "mla"
                     else 2 * self.kv_heads * self.head_dim)
        return per_layer * self.layers * ACTIVATION_BYTES

    def kv_bytes_per_gpu_per_token(self, tp: int) -> float:
        """MLA's latent cache is replicated on every rank; GQA's heads split over at most num_key_value_heads."""
        if self.attention == "mla":
            return float(self.kv_bytes_per_token)
        return self.kv_bytes_per_token / min(tp, self.kv_heads)

    # bytes a forward reads, the whole model (divide by the GPUs)

    @property
    def fixed_weight_bytes(self) -> float:
        b = self.bits
        return (self.layers * self.attention_params * b.attention
                + self.dense_layers * 3 * self.hidden * self.intermediate * b.dense_mlp
                + self.moe_layers * (3 * self.hidden * self.shared_intermediate * b.shared + self.hidden
                                     * self.experts * 16)
                + self.vocab * self.hidden * b.lm_head) / 8

    @property
    def all_expert_bytes(self) -> float:
        return self.moe_layers * self.experts * self.expert_params * self.bits.experts / 8

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts per MoE layer that `tokens` tokens route to (uniform routing)."""
        if not self.experts:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)

    def describe(self) -> str:
        kind = (f"MoE, {self.experts} routed experts ({self.experts_per_token} active"
                + (f" + shared {self.shared_intermediate} wide" if self.shared_intermediate else "")
                + f"), {self.dense_layers} dense layer(s)") if self.experts else "dense"
        attn = (f"MLA (kv_lora_rank {self.kv_lora_rank} + rope {self.qk_rope_head_dim})" if self.attention == "mla"
                else f"GQA ({self.heads} heads, {self.kv_heads} KV heads)")
        return (f"{self.name}: {kind}, {self.layers} layers, hidden {self.hidden}, {attn}, "
                f"{self.total_params / 1e9:.4g}B parameters ({self.active_params / 1e9:.4g}B active per token), "
                f"{self.bits.scheme}; KV cache {self.kv_bytes_per_token} bytes per token")


@dataclass(frozen=True)
class Parallelism:
    """How the serving engine spreads the verifier: tp ranks, experts over ep ranks (1: sliced by tp)."""

    tp: int
    ep: int = 1
    # SGLang reads an MLA verifier's A-projection (fused_qkv_a_proj_with_mqa, a ReplicatedLinear) whole on every
    # rank: sglang 0.5.23's wheel, sglang/srt/models/deepseek_v2.py (DeepseekV2AttentionMLA.__init__)
    mla_a_replicated: bool = False
    # SGLang's dp-attention (--dp-size): attention weights sliced over tp / dp ranks, not tp (sglang 0.5.23,
    # sglang/srt/layers/dp_attention.py: the attention TP group is tp_size // dp_size)
    attention_dp: int = 1

    def __post_init__(self) -> None:
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep must be 1 (experts sliced by tensor parallelism) or the tp ({self.tp}), "
                             f"got {self.ep}")


@dataclass(frozen=True)
class VerifierCost:
    """One verifier forward (no communication) over n tokens on each GPU, and the collectives each forward issues.

    `measured_ms[i]`: a forward over i + 1 tokens as probe-verifier timed its layers; beyond what it timed, its
    last value plus the model's growth. Times in ms."""

    name: str
    description: str
    fixed_ms: float
    all_experts_ms: float
    experts: int
    experts_per_token: int
    per_token_ms: float
    allreduce_calls: int
    alltoall_calls: int
    alltoall_bytes_per_token: int
    hidden: int
    ep: int = 1
    measured_ms: tuple[float, ...] | None = None
    basis: dict[str, str] = field(default_factory=dict)

    def modelled_ms(self, tokens: int) -> float:
        touched = 1 - (1 - self.experts_per_token / self.experts) ** tokens if self.experts else 0.0
        return self.fixed_ms + self.all_experts_ms * touched + self.per_token_ms * tokens

    def ms(self, tokens: int) -> float:
        measured = self.measured_ms
        if not measured:
            return self.modelled_ms(tokens)
        if tokens <= len(measured):
            return measured[tokens - 1]
        return measured[-1] + self.modelled_ms(tokens) - self.modelled_ms(len(measured))


def verifier_cost(shape: VerifierShape, parallel: Parallelism, hbm_bytes_per_s: float = DEFAULT_HBM_BYTES_PER_S,
                  tflops: float = DEFAULT_TFLOPS, context_tokens: int = DEFAULT_KV_CONTEXT_TOKENS,
                  measured: dict[str, Any] | None = None) -> VerifierCost:
    """The verifier's cost on `parallel`; `measured`: a stored probe-verifier answer for this shape."""
    tp, ep = parallel.tp, parallel.ep
    to_ms = 1000 / hbm_bytes_per_s
    kv = shape.kv_bytes_per_gpu_per_token(tp) * context_tokens
    a_proj = (shape.layers * shape.hidden * (shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim)
              * shape.bits.attention / 8 if parallel.mla_a_replicated and shape.attention == "mla" else 0.0)
    attn_tp = max(1, tp // parallel.attention_dp)
    attention = shape.layers * shape.attention_params * shape.bits.attention / 8
    fixed_ms = ((shape.fixed_weight_bytes - attention) / tp + attention / attn_tp + a_proj * (1 - 1 / attn_tp)
                + kv) * to_ms
    moe_calls = shape.moe_layers if ep > 1 else 0
    allreduce_calls = 2 * shape.layers - moe_calls if tp > 1 else 0
    cost = VerifierCost(
        name=shape.name, description=shape.describe(), fixed_ms=fixed_ms,
        all_experts_ms=shape.all_expert_bytes / tp * to_ms, experts=shape.experts,
        experts_per_token=shape.experts_per_token, per_token_ms=2 * shape.active_params / tp / (tflops * 1e12) * 1e3,
        allreduce_calls=allreduce_calls, alltoall_calls=2 * moe_calls if tp > 1 else 0,
        alltoall_bytes_per_token=shape.experts_per_token * shape.hidden * ACTIVATION_BYTES, hidden=shape.hidden,
        ep=ep)
    placement = (f"experts over ep={ep} ranks ({shape.experts // ep} whole experts per GPU)" if ep > 1 else
                 f"every expert sliced over tp={tp} ({shape.experts} experts, 1/{tp} of each, per GPU)"
                 if shape.experts else f"dense, sliced over tp={tp}")
    basis = {
        "verifier_forward": (
            f"modelled from {shape.name}'s config.json: {shape.fixed_weight_bytes / 1e9:.4g} GB read every forward"
            + (f" + {shape.all_expert_bytes / 1e9:.4g} GB of routed experts x the share n tokens touch "
               f"(1 - (1 - {shape.experts_per_token}/{shape.experts})^n)" if shape.experts else "")
            + f", over tp={tp} GPUs at {hbm_bytes_per_s / 1e12:g} TB/s; KV cache {shape.kv_bytes_per_token} B/token "
            f"x {context_tokens} tokens of context ({'replicated per rank: MLA' if shape.attention == 'mla' else 'GQA'}"
            f"); 2 x {shape.active_params / 1e9:.4g}B active parameters per token at {tflops:g} TFLOP/s; {placement}"
            + (f"; the MLA A-projection ({a_proj / 1e9:.3g} GB) read whole on every rank, as SGLang replicates it "
               "(sglang 0.5.23, sglang/srt/models/deepseek_v2.py: fused_qkv_a_proj_with_mqa is a ReplicatedLinear)"
               if a_proj and attn_tp > 1 else "")
            + (f"; dp-attention (dp {parallel.attention_dp}): attention's {attention / 1e9:.3g} GB sliced over "
               f"{attn_tp} rank(s), not {tp}" if parallel.attention_dp > 1 else "")),
        "verifier_collectives": (
            f"{allreduce_calls} all-reduces per forward" + (
                f" and {2 * moe_calls} all-to-alls (dispatch + combine in {moe_calls} MoE layers, "
                f"{cost.alltoall_bytes_per_token} bytes per token; modelled as one all-reduce call of the same bytes "
                "each: no all-to-all table is measured)" if moe_calls and tp > 1 else "")
            if tp > 1 else "tp=1: none"),
    }
    if measured:
        cost = _with_measured(cost, shape, measured, tp, to_ms)
        basis["verifier_forward"] = cost.basis["verifier_forward"]
    return VerifierCost(**{**cost.__dict__, "basis": basis})


def _with_measured(cost: VerifierCost, shape: VerifierShape, probe: dict[str, Any], tp: int,
                   to_ms: float) -> VerifierCost:
    """The forward from probe-verifier's layer times: dense x dense_layers + MoE x moe_layers + the lm head read."""
    if probe.get("tp") != tp or probe.get("ep", 1) != cost.ep:
        raise ValueError(f"the verifier probe timed a tp={probe.get('tp')} ep={probe.get('ep', 1)} layer, not "
                         f"tp={tp} ep={cost.ep}")
    dense, moe = probe.get("dense_ms") or [], probe.get("moe_ms") or []
    count = min(len(dense) if shape.dense_layers else math.inf, len(moe) if shape.moe_layers else math.inf)
    if not count or count == math.inf:
        raise ValueError("the verifier probe has no layer times for this shape")
    head_ms = shape.vocab * shape.hidden * shape.bits.lm_head / 8 / tp * to_ms
    forward = tuple(shape.dense_layers * (dense[i] if shape.dense_layers else 0.0)
                    + shape.moe_layers * (moe[i] if shape.moe_layers else 0.0) + head_ms for i in range(int(count)))
    why = (f"measured on {probe.get('host')} by probe-verifier at {probe.get('measured_at')}: one layer of "
           f"{shape.name}'s shape ({probe.get('dtype')}, random weights, torch kernels: an upper bound on an "
           f"engine's fused ones) on {probe.get('gpu')} at 1..{int(count)} tokens, x {shape.layers} layers; the lm "
           f"head's read modelled; beyond {int(count)} tokens the model's growth; the model (bytes and FLOPs alone) "
           f"says {cost.modelled_ms(1):.3g} ms at 1 token against {forward[0]:.3g} ms measured "
           f"({forward[0] / cost.modelled_ms(1):.2g}x): the measured forward is priced")
    return VerifierCost(**{**cost.__dict__, "measured_ms": forward, "basis": {"verifier_forward": why}})


def read_config(path: str) -> dict:
    """config.json at `path` (a file, or a model directory holding one): untrusted, so size-bounded and JSON only."""
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if os.path.basename(file) != "config.json":
        raise ValueError(f"{path}: the verifier is named by its config.json or its model directory")
    with open(file, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"{file} is larger than {MAX_CONFIG_BYTES} bytes: not a model config")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{file} is not JSON: {exc}") from None


def name_of(path: str, config: dict) -> str:
    """A model's name for answers: its directory's, else its architecture."""
    directory = os.path.dirname(path) if path.endswith(".json") else path
    base = os.path.basename(directory.rstrip("/"))
    arch = (config.get("architectures") or ["?"])[0] if isinstance(config.get("architectures"), list) else "?"
    return f"{base or arch} ({arch})"


def draft_params(shape: VerifierShape, draft_vocab: int) -> int:
    """An EAGLE-3 draft of this verifier: one decoder layer of its hidden size (attention over the 2 x hidden
    input, the verifier's dense MLP width), the fc fusing 3 captured layers, and a draft_vocab head."""
    h = shape.hidden
    # an MLA verifier's draft is GQA: 8 KV heads of 128 (the trainer's draft_num_kv_heads / draft_head_dim)
    kv = 2 * shape.kv_heads * shape.head_dim if shape.attention == "gqa" else 2 * 8 * 128
    return 2 * h * h + 2 * h * kv + h * h + 3 * h * shape.intermediate + 3 * h * h + draft_vocab * h


def read_probe(answer: Any, host: str, measured_at: str) -> dict[str, Any]:
    """worker/verifier_probe.py's answer (untrusted), checked, as stored beside the host's all-reduce table
    (`host.interconnect["verifier"]`); ValueError with the reason when it is not a measurement."""
    if not isinstance(answer, dict):
        raise ValueError("the verifier probe did not answer a JSON object")
    if "error" in answer:
        raise ValueError(f"the verifier probe could not measure: {str(answer['error'])[:1000]}")
    path, config, tp, ep = answer.get("path"), answer.get("config"), answer.get("tp"), answer.get("ep", 1)
    if not isinstance(path, str) or not isinstance(config, dict) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024 for n in (tp, ep)):
        raise ValueError("the verifier probe's answer has no path, config, tp and ep")
    VerifierShape.from_config(config)  # a config the advisor can price
    stored: dict[str, Any] = {"path": path[:4096], "config": config, "tp": tp, "ep": ep, "host": host,
                              "measured_at": measured_at, "gpu": str(answer.get("gpu") or "")[:128],
                              "dtype": str(answer.get("dtype") or "")[:128]}
    for key in ("dense_ms", "moe_ms"):
        rows = answer.get(key)
        if rows is None:
            continue
        if not isinstance(rows, list) or not 1 <= len(rows) <= 64 or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in rows):
            raise ValueError(f"the verifier probe's {key} is not a list of up to 64 times > 0")
        stored[key] = [float(v) for v in rows]
    stored["layers_ms_ok"] = bool(stored.get("dense_ms") or stored.get("moe_ms"))
    return stored
