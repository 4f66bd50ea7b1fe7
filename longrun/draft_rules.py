"""The parts of how vLLM, SGLang and speculators read an exported EAGLE-3 draft that every engine shares: the
draft's sizes from its config, every tensor checked by name and shape against the parameters the engine builds, the
verifier's sizes and layer range. The engines' own rules, release by release, are longrun/draft_engines.py, from
the facts read in their wheels (longrun/draft_releases.py); what no loader stops but the engine would still misread
(RoPE, norm_before_residual, capture layers against the trained ones) is longrun/draft_misreads.py.
`longrun check-draft` runs them. Nothing here imports torch: a draft is its config.json and its safetensors header.
"""

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("vllm", "sglang", "speculators")
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
INTEGER_DTYPES = {"I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64"}
DEFAULT_ROPE_THETA = 10000.0  # transformers' LlamaConfig default: what every engine builds without one
# the keys of rope_scaling that set the rotation's frequencies; attn_factor / attention_factor / mscale scale cos and
# sin and longrun writes attn_factor for the engines (trainer/model.py engine_rope_scaling), so they are not compared
ROPE_FREQUENCY_KEYS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                       "beta_fast", "beta_slow")


@dataclass
class EngineReading:
    engine: str
    version: str = ""  # the engine release the rules are applied for
    rules: str = ""  # whose code they follow
    capture_layers: list[int] | None = None  # inputs of verifier layers the engine will capture
    capture_source: str = ""  # the key it took them from, or "default"
    capture_default: bool = False  # the engine takes the verifier's default layers (2, N/2, N-3)
    ignored: list[str] = field(default_factory=list)  # the draft's settings this engine does not read
    refused: list[str] = field(default_factory=list)  # why serving this export there would go wrong
    sources: list[str] = field(default_factory=list)  # the loader code each refusal mirrors, in the same order
    notes: list[str] = field(default_factory=list)
    unverified: str | None = None  # why the release's rules are not known (newer than the newest read)

    def refuse(self, reason: str, source: str) -> None:
        self.refused.append(reason)
        self.sources.append(source.format(v=self.version))


@dataclass(frozen=True)
class Verifier:
    """What the rules need of the verifier's config.json (its text_config where it has one)."""

    hidden_size: int | None
    vocab_size: int | None
    num_layers: int | None
    architectures: tuple[str, ...] = ()
    rope: tuple | None = None  # (rope_theta, scaling) as draft_misreads.rope_of reads them
    moe: bool = False  # vLLM's model_config.is_moe: an expert count in its config
    quantized: bool = False  # a quantization_config

    @classmethod
    def from_config(cls, config: dict) -> "Verifier":
        text = config.get("text_config") or config
        experts = next((text[k] for k in ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
                        if text.get(k)), 0)
        return cls(text.get("hidden_size"), text.get("vocab_size"), text.get("num_hidden_layers"),
                   tuple(config.get("architectures") or ()), rope_of(text), bool(experts),
                   bool(config.get("quantization_config") or text.get("quantization_config")))


def rope_of(config: dict) -> tuple[float, tuple | None]:
    """(rope_theta, the scaling's type and frequency keys or None) as an engine builds them from a Llama config:
    rope_theta, else rope_parameters' (transformers 5), else 10000; rope_scaling, else rope_parameters where its type
    is not `default`."""
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = config.get("rope_theta") or params.get("rope_theta") or DEFAULT_ROPE_THETA
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if not scaling or kind in (None, "default"):
        return float(theta), None
    return float(theta), (kind, *((k, scaling[k]) for k in ROPE_FREQUENCY_KEYS if scaling.get(k) is not None))


def read_verifier(directory: Path | None) -> Verifier | None:
    if directory is None:
        return None
    return Verifier.from_config(json.loads((directory / "config.json").read_text()))


def safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's dtype and shape, from a safetensors file's header (8-byte length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    return {name: (info["dtype"], list(info["shape"])) for name, info in header.items() if name != "__metadata__"}


def default_layers(num_layers: int | None) -> list[int] | None:
    return None if num_layers is None else [2, num_layers // 2, num_layers - 3]


@dataclass
class Shapes:
    """The draft's sizes as the engine reads them from its config."""

    hidden: int
    target_hidden: int
    vocab: int
    draft_vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int


def draft_shapes(layer: dict, draft_vocab, target_hidden) -> Shapes:
    """Shapes from a Llama layer config (KeyError names a key the engine needs and the config lacks)."""
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    return Shapes(
        hidden=hidden, target_hidden=target_hidden or hidden, vocab=layer["vocab_size"],
        draft_vocab=draft_vocab or layer["vocab_size"], intermediate=layer["intermediate_size"], heads=heads,
        kv_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or hidden // heads,
        layers=layer.get("num_hidden_layers", 1),
    )


def expected_tensors(s: Shapes, aux: int, fc_norm: bool, norm_before_fc: bool, fc_feature: int) -> dict[str, list[int]]:
    """Every parameter the engine builds, named as in the file (decoder layer i: `layers.{i}.`, which engine exports
    write `midlayer.` for layer 0), with its shape ([out, in] for linears)."""
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    expected = {"fc.weight": [h, aux * fc_feature], "norm.weight": [h], "lm_head.weight": [s.draft_vocab, h]}
    if fc_norm:
        expected.update({f"fc_norm.{i}.weight": [fc_feature] for i in range(aux)})
    if norm_before_fc:
        expected["input_norm.weight"] = [aux * fc_feature]
    for i in range(s.layers):
        p, width = f"layers.{i}.", 2 * h if i == 0 else h  # layer 0 reads [embedding, hidden]
        expected.update({
            f"{p}input_layernorm.weight": [h], f"{p}hidden_norm.weight": [h],
            f"{p}post_attention_layernorm.weight": [h],
            f"{p}self_attn.q_proj.weight": [q, width], f"{p}self_attn.k_proj.weight": [kv, width],
            f"{p}self_attn.v_proj.weight": [kv, width], f"{p}self_attn.o_proj.weight": [h, q],
            f"{p}mlp.gate_proj.weight": [s.intermediate, h], f"{p}mlp.up_proj.weight": [s.intermediate, h],
            f"{p}mlp.down_proj.weight": [h, s.intermediate],
        })
    return expected


@dataclass
class Loader:
    """One engine's treatment of tensor names. `canonical` maps a file name to the parameter it loads into, named
    as `expected_tensors` names them (None: the engine has no such parameter); the texts say what the engine does
    with a missing, unknown or misshapen tensor, and which code does it."""

    expected: dict[str, list[int]]
    optional: dict[str, list[int]]
    canonical: Callable[[str], str | None]
    missing: str
    unknown: str
    misshapen: str
    missing_source: str
    unknown_source: str
    layer0: str = "layers.0."  # how the file names decoder layer 0, for the names a refusal gives
    special_missing: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (what happens, source)


def check_tensors(reading: EngineReading, tensors: dict[str, tuple[str, list[int]]], loader: Loader,
                  config_says: str) -> None:
    """Every tensor by name and shape: each parameter the engine builds must be in the file, with the shape the
    config gives it; each name the engine would not load is refused with what the engine does with it."""
    found: set[str] = set()
    for name, (_, shape) in sorted(tensors.items()):
        key = loader.canonical(name)
        if key is None or (key not in loader.expected and key not in loader.optional):
            reading.refuse(f"{name} is not a parameter of the draft {reading.engine} builds: {loader.unknown}",
                           loader.unknown_source)
            continue
        if key in found:
            reading.refuse(f"{name} loads into {key} a second time", loader.unknown_source)
        found.add(key)
        want = loader.expected.get(key) or loader.optional.get(key)
        if list(shape) != want:
            reading.refuse(f"{name} is {list(shape)}; {config_says} it needs {want}: {loader.misshapen}",
                           loader.unknown_source)
    for key in sorted(set(loader.expected) - found):
        what, source = loader.special_missing.get(key, (loader.missing, loader.missing_source))
        shown = loader.layer0 + key.removeprefix("layers.0.") if key.startswith("layers.0.") else key
        reading.refuse(f"model.safetensors has no {shown}: {what}", source)


def check_vocab_map(reading: EngineReading, tensors: dict, s: Shapes, effect: str, source: str) -> None:
    if "d2t" not in tensors and s.draft_vocab != s.vocab:
        reading.refuse(f"model.safetensors has no d2t: {reading.engine} {effect} "
                       f"(draft vocab {s.draft_vocab} of {s.vocab})", source)


def check_against_verifier(reading: EngineReading, s: Shapes, verifier: Verifier | None, shares_embedding: bool,
                            fc_feature: int, source: str) -> None:
    """The draft's sizes the verifier fixes: its vocabulary (the target ids d2t maps to), the width of the features
    fc reads, and the hidden size where the engine feeds the draft the verifier's embedding."""
    if verifier is None:
        return
    if verifier.vocab_size is not None and s.vocab != verifier.vocab_size:
        reading.refuse(f"the draft's vocab_size is {s.vocab} and the verifier's {verifier.vocab_size}: its d2t and "
                       "lm_head map into another vocabulary", source)
    if verifier.hidden_size is not None and fc_feature != verifier.hidden_size:
        reading.refuse(f"fc reads features of {fc_feature} but the verifier's hidden size is "
                       f"{verifier.hidden_size}", source)
    if shares_embedding and verifier.hidden_size is not None and s.hidden != verifier.hidden_size:
        reading.refuse(f"the draft's hidden_size is {s.hidden}; {reading.engine} feeds it the verifier's embedding "
                       f"of {verifier.hidden_size}", source)


def check_capture(reading: EngineReading, aux: int, verifier: Verifier | None, lowest: int, highest_offset: int,
                   source: str, range_source: str) -> None:
    """The layer ids against the count fc reads and the verifier's layers (`lowest`..N - `highest_offset`)."""
    ids = reading.capture_layers
    if ids is None:
        return
    if len(ids) != aux:
        reading.refuse(f"{reading.engine} captures {len(ids)} layers {ids} but fc reads {aux} features", source)
    if verifier is not None and verifier.num_layers is not None:
        top = verifier.num_layers - highest_offset
        if any(i < lowest or i > top for i in ids):
            reading.refuse(f"layer ids {ids} ({reading.capture_source}) are outside the {lowest}..{top} "
                           f"{reading.engine} can capture of a verifier of {verifier.num_layers} layers",
                           range_source)


def check_flags(reading: EngineReading, config: dict, reads: dict[str, bool], needs: str, source: str) -> None:
    """EAGLE 3.1's flags (and norm_before_fc) that are on in the config and that this release does not read."""
    for flag, read in reads.items():
        if config.get(flag) and not read:
            reading.ignored.append(flag)
            reading.refuse(f"{flag} is on and {reading.engine} {reading.version} does not read it (it is read from "
                           f"{needs}): it would run another draft than the one trained", source)


def sizes(s: Shapes) -> str:
    return (f"hidden {s.hidden}, target hidden {s.target_hidden}, vocab {s.vocab}, draft vocab {s.draft_vocab}, "
            f"intermediate {s.intermediate}, heads {s.heads}/{s.kv_heads} of {s.head_dim}")
