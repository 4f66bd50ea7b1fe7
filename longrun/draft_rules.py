"""How vLLM, SGLang and speculators read an exported EAGLE-3 draft, release by release: which config keys each reads,
the parameters it builds from them, what it does with each tensor name (loads it, remaps it, skips it, fails), and
which verifier layers it captures. `longrun check-draft` runs these rules; every refusal names the loader code it
mirrors. Nothing here imports torch: a draft is its config.json and its safetensors header.

The rules were read from the engines' own code, in the releases on PyPI (wheels unpacked) and at the commits named:

vLLM (`vllm/model_executor/models/llama_eagle3.py`, `vllm/model_executor/models/utils.py` AutoWeightsLoader,
`vllm/model_executor/model_loader/default_loader.py`, `vllm/v1/spec_decode/eagle.py`,
`vllm/v1/worker/gpu_model_runner.py`, `vllm/transformers_utils/configs/speculators/algos.py`), read in the 0.21.0,
0.22.0, 0.24.0, 0.25.0 and 0.27.0 wheels, and llama_eagle3.py @ 00bd149, eagle.py @ 008603a, default_loader.py @
00b5ad0 of vllm-project/vllm:
- names: `midlayer.` -> `layers.0.`, q/k/v and gate/up stacked, `t2d` dropped, `d2t` -> draft_id_to_target_id (skipped
  when absent: zeros, so draft id i proposes target id i), `embed_tokens` optional (absent: the verifier's is shared,
  eagle.py load_model), `input_norm.` skipped unless norm_before_fc; any other name that is not a parameter stops the
  load (AutoWeightsLoader: "There is no module or parameter named ..."); a shape that differs stops it too (the weight
  loaders assert it);
- a parameter the file lacks stays uninitialised: Eagle3LlamaForCausalLM.load_weights returns None, so
  DefaultModelLoader never runs track_weights_loading; a missing lm_head makes eagle.py share the verifier's;
- `tie_word_embeddings` is not read (the draft builds its own ParallelLMHead);
- before 0.22.0: fc reads 3 features, capture layers from the top-level `eagle_aux_hidden_state_layer_ids` only
  (gpu_model_runner.py), neither `fc_norm` nor `norm_output` (fc_norm.* weights then stop the load as unknown);
- 0.22.0 (PR #42764): `fc_norm` (an RMSNorm per feature, `fc_norm.{i}.weight` [target_hidden]) and `norm_output` read
  from the draft's config; fc reads len(eagle_config.eagle_aux_hidden_state_layer_ids) features (else 3); capture
  layers fall back to `eagle_config`'s ids, taken as inputs of layers;
- speculators' format: algos.py update_eagle3 passes on draft_vocab_size, target_hidden_size, the layer ids,
  norm_before_residual (true when absent) and norm_before_fc; `fc_norm` and `norm_output` only from 0.25.0
  (PR #46488; before it an EAGLE 3.1 speculators export runs as EAGLE 3 without a word).

SGLang (`python/sglang/srt/models/llama_eagle3.py`, `models/llama.py` set_eagle3_layers_to_capture,
`model_executor/model_runner.py` and, in 0.5.23, `model_runner_components/spec_aux_hidden_state.py`,
`speculative/eagle_worker_v2.py` init_lm_head), read in the 0.5.11, 0.5.12, 0.5.16, 0.5.17 and 0.5.23 wheels, and
llama_eagle3.py @ 03d5a77 of sgl-project/sglang:
- load_weights looks each name up (`name`, else `model.` + name) and loads it only `if param_name in params_dict`:
  every other name is skipped without a word, and nothing checks that every parameter was loaded;
- `d2t` -> hot_token_id = d2t + arange (no length check), `t2d` dropped; the verifier's embedding replaces the
  draft's (set_embed); `tie_word_embeddings: true` makes lm_head the embedding, so the file's lm_head.weight is
  skipped and the verifier's embedding scores the draft vocabulary; no `draft_vocab_size` makes it take the
  verifier's lm_head (load_lm_head_from_target);
- capture layers: `eagle_config.eagle_aux_hidden_state_layer_ids` as outputs of layers (it captures the input of
  id + 1, layers 0..N-1 only); without them (2, N // 2, N - 3); the top-level key is not read;
- before 0.5.12: the layer is `midlayer.*` only (speculators' `layers.0.*` names are skipped), fc reads 3 features,
  no `fc_norm`, no `norm_output`;
- 0.5.12 (PR #24663): `midlayer` -> `layers.0` (both names load), `fc_norm` (or `use_aux_norm`; legacy
  `aux_norm_low/mid/high` -> fc_norm.0/1/2), `norm_output`, fc reads len(eagle_config ids) features;
- 0.5.17: `norm_before_fc` (`input_norm.weight`).
Architectures: `LlamaForCausalLMEagle3` (EntryClass), not speculators' `Eagle3DraftModel`.

speculators 0.9.0 (pip; src/speculators/models/eagle3/core.py Eagle3DraftModel, src/speculators/model.py): its own
format only (`speculators_model_type`); fc reads len(eagle_aux_hidden_state_layer_ids) (else 3) features of
hidden_size (not target_hidden_size); `layers.0.*`; `fc_norm`, `norm_output`, `norm_before_fc`, `norm_before_residual`;
`tie_word_embeddings` forced false; d2t, t2d, input_norm and the verifier_* weights may be missing; a missing
embed_tokens.weight is left uninitialised and a missing lm_head.weight is replaced by the verifier's rows (both NaN
checks, `_load_verifier_weights`); unknown names are dropped with transformers' warning; null layer ids mean the
verifier's (2, N // 2, N - 3).
"""

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ENGINES = ("vllm", "sglang", "speculators")
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"

# The releases whose code the rules were read from; a version between two of them follows the older one.
READ_RELEASES = {
    "vllm": ("0.21.0", "0.22.0", "0.24.0", "0.25.0", "0.27.0"),
    "sglang": ("0.5.11", "0.5.12", "0.5.16", "0.5.17", "0.5.23"),
    "speculators": ("0.9.0",),
}
VLLM_FC_NORM = (0, 22, 0)  # PR #42764: fc_norm, norm_output, eagle_config's ids and count
VLLM_SPECULATORS_FC_NORM = (0, 25, 0)  # PR #46488: algos.py passes fc_norm and norm_output on
SGLANG_FC_NORM = (0, 5, 12)  # PR #24663: fc_norm, norm_output, layers.N names, eagle_config's count
SGLANG_NORM_BEFORE_FC = (0, 5, 17)

SRC = {
    "vllm_load": "vllm {v} llama_eagle3.py Eagle3LlamaForCausalLM.load_weights + utils.py AutoWeightsLoader",
    "vllm_missing": "vllm {v} llama_eagle3.py load_weights returns None, default_loader.py skips "
                    "track_weights_loading",
    "vllm_lm_head": "vllm {v} v1/spec_decode/eagle.py load_model (has_own_lm_head)",
    "vllm_d2t": "vllm {v} llama_eagle3.py load_weights (d2t) and compute_logits",
    "vllm_config": "vllm {v} llama_eagle3.py LlamaModel.__init__",
    "vllm_capture": "vllm {v} v1/worker/gpu_model_runner.py (eagle_aux_hidden_state_layer_ids)",
    "vllm_range": "vllm {v} models/llama.py LlamaModel.forward (_maybe_add_hidden_state at 0..N)",
    "vllm_algos": "vllm {v} transformers_utils/configs/speculators/algos.py update_eagle3",
    "sglang_load": "sglang {v} models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights "
                   "(if param_name in params_dict)",
    "sglang_config": "sglang {v} models/llama_eagle3.py LlamaModel.__init__",
    "sglang_head": "sglang {v} models/llama_eagle3.py LlamaForCausalLMEagle3.__init__ (tie_word_embeddings, "
                   "draft_vocab_size)",
    "sglang_d2t": "sglang {v} models/llama_eagle3.py load_weights (hot_token_id = d2t + arange)",
    "sglang_capture": "sglang {v} model_runner (eagle_config ids) + models/llama.py set_eagle3_layers_to_capture",
    "sglang_arch": "sglang {v} models/llama_eagle3.py EntryClass",
    "spec_load": "speculators {v} models/eagle3/core.py Eagle3DraftModel (transformers from_pretrained)",
    "spec_verifier": "speculators {v} model.py _load_verifier_weights (NaN checks)",
    "spec_config": "speculators {v} models/eagle3/core.py Eagle3DraftModel.__init__",
    "spec_d2t": "speculators {v} model.py DraftVocabMixin._init_vocab (d2t zeros)",
}


def parse_version(text: str) -> tuple[int, ...]:
    """'0.22.0', 'v0.22', '0.5.12.post1', '0.25.0rc1' -> (0, 22, 0) ...: the release's numbers."""
    match = re.match(r"^v?(\d+(?:\.\d+)*)", text.strip())
    if not match:
        raise ValueError(f"not a version: {text!r} (e.g. 0.22.0)")
    numbers = tuple(int(n) for n in match.group(1).split("."))
    return numbers + (0,) * (3 - len(numbers))


def default_version(engine: str) -> str:
    return READ_RELEASES[engine][-1]


@dataclass
class EngineReading:
    engine: str
    version: str = ""  # the engine release the rules are applied for
    rules: str = ""  # whose code they follow
    capture_layers: list[int] | None = None  # inputs of verifier layers the engine will capture
    capture_source: str = ""  # the key it took them from, or "default"
    ignored: list[str] = field(default_factory=list)  # the draft's settings this engine does not read
    refused: list[str] = field(default_factory=list)  # why serving this export there would go wrong
    sources: list[str] = field(default_factory=list)  # the loader code each refusal mirrors, in the same order
    notes: list[str] = field(default_factory=list)

    def refuse(self, reason: str, source: str) -> None:
        self.refused.append(reason)
        self.sources.append(source.format(v=self.version))


@dataclass(frozen=True)
class Verifier:
    """What the rules need of the verifier's config.json (its text_config where it has one)."""

    hidden_size: int | None
    vocab_size: int | None
    num_layers: int | None

    @classmethod
    def from_config(cls, config: dict) -> "Verifier":
        text = config.get("text_config") or config
        return cls(text.get("hidden_size"), text.get("vocab_size"), text.get("num_hidden_layers"))


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


def _check_vocab_map(reading: EngineReading, tensors: dict, s: Shapes, effect: str, source: str) -> None:
    if "d2t" not in tensors and s.draft_vocab != s.vocab:
        reading.refuse(f"model.safetensors has no d2t: {reading.engine} {effect} "
                       f"(draft vocab {s.draft_vocab} of {s.vocab})", source)


def _check_against_verifier(reading: EngineReading, s: Shapes, verifier: Verifier | None, shares_embedding: bool,
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


def _check_capture(reading: EngineReading, aux: int, verifier: Verifier | None, lowest: int, highest_offset: int,
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


def _flags(reading: EngineReading, config: dict, reads: dict[str, bool], needs: str, source: str) -> None:
    """EAGLE 3.1's flags (and norm_before_fc) that are on in the config and that this release does not read."""
    for flag, read in reads.items():
        if config.get(flag) and not read:
            reading.ignored.append(flag)
            reading.refuse(f"{flag} is on and {reading.engine} {reading.version} does not read it (it is read from "
                           f"{needs}): it would run another draft than the one trained", source)


def read_vllm(config: dict, tensors: dict, verifier: Verifier | None, version: str) -> EngineReading:
    v = parse_version(version)
    reading = EngineReading("vllm", version, rules=_rules("vllm", version))
    speculators = "speculators_model_type" in config
    eagle_config = config.get("eagle_config") or {}
    try:
        if speculators:
            layer = config.get("transformer_layer_config") or {}
            s = draft_shapes(layer, config.get("draft_vocab_size"), config.get("target_hidden_size"))
        else:
            s = draft_shapes(config, config.get("draft_vocab_size"), config.get("target_hidden_size"))
    except KeyError as exc:
        reading.refuse(f"config.json lacks {exc.args[0]}: vLLM cannot build the draft", SRC["vllm_config"])
        return reading
    reads_31 = v >= (VLLM_SPECULATORS_FC_NORM if speculators else VLLM_FC_NORM)
    flags_source = SRC["vllm_algos"] if speculators else SRC["vllm_config"]
    norm_before_fc = bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc")))
    needs = ("vllm 0.25.0 in speculators' format, PR #46488" if speculators else "vllm 0.22.0, PR #42764")
    _flags(reading, config, {"fc_norm": reads_31, "norm_output": reads_31}, needs, flags_source)
    if speculators:
        if "norm_before_residual" not in config:
            reading.refuse("speculators config without norm_before_residual: vLLM takes it as true",
                           SRC["vllm_algos"])
        elif config["norm_before_residual"]:
            reading.notes.append("norm_before_residual: true (longrun trains false)")
    elif config.get("norm_before_residual"):
        reading.notes.append("norm_before_residual: true (longrun trains false)")
    if config.get("tie_word_embeddings") or (config.get("transformer_layer_config") or {}).get("tie_word_embeddings"):
        reading.ignored.append("tie_word_embeddings")
        reading.notes.append("tie_word_embeddings is not read: vLLM loads the draft's own lm_head.weight")

    # capture layers and the number of features fc reads
    ids, source = config.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids"
    if not (ids and isinstance(ids, list)) and v >= VLLM_FC_NORM:
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        source = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if ids and isinstance(ids, list):
        reading.capture_layers, reading.capture_source = list(ids), source
    elif verifier is not None:
        reading.notes.append("no layer ids: vLLM captures the verifier's default layers")
    if v >= VLLM_FC_NORM and not speculators:
        counted = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        aux = config.get("num_aux_hidden_states") or (len(counted) if counted else 3)
    else:
        aux = 3
    _check_capture(reading, aux, verifier, 0, 0, SRC["vllm_config"], SRC["vllm_range"])

    fc_norm = bool(config.get("fc_norm")) and reads_31
    expected = expected_tensors(s, aux, fc_norm, norm_before_fc, s.target_hidden)
    optional = {"embed_tokens.weight": [s.vocab, s.hidden], "d2t": [s.draft_vocab]}
    if "input_norm.weight" in tensors and not norm_before_fc:
        reading.refuse("input_norm.weight with norm_before_fc off: vLLM skips it (skip_substrs 'input_norm.')",
                       SRC["vllm_load"])
    loader = Loader(
        expected=expected, optional=optional, canonical=lambda n: n.replace("midlayer.", "layers.0."),
        missing="vLLM leaves that parameter uninitialised",
        unknown="vLLM stops at load (ValueError: There is no module or parameter named ...)",
        misshapen="vLLM's weight loader asserts the shape and stops",
        missing_source=SRC["vllm_missing"], unknown_source=SRC["vllm_load"],
        layer0="layers.0." if speculators else "midlayer.",
        special_missing={"lm_head.weight": ("vLLM shares the verifier's lm_head in its place, not the trained one",
                                            SRC["vllm_lm_head"])},
    )
    dropped = {"t2d"} | (set() if norm_before_fc else {"input_norm.weight"})  # skipped before loading
    check_tensors(reading, {n: t for n, t in tensors.items() if n not in dropped}, loader,
                  f"{'transformer_layer_config' if speculators else 'the config'} ({_sizes(s)})")
    _check_vocab_map(reading, tensors, s, "keeps a zero draft-to-target map and proposes draft ids as target ids",
                     SRC["vllm_d2t"])
    _check_against_verifier(reading, s, verifier, "embed_tokens.weight" not in tensors, s.target_hidden,
                            SRC["vllm_config"])
    return reading


def read_sglang(config: dict, tensors: dict, verifier: Verifier | None, version: str) -> EngineReading:
    v = parse_version(version)
    reading = EngineReading("sglang", version, rules=_rules("sglang", version))
    if "speculators_model_type" in config or SGLANG_ARCHITECTURE not in (config.get("architectures") or []):
        reading.refuse(f"SGLang loads {SGLANG_ARCHITECTURE} drafts, not {config.get('architectures')}: "
                       "serve the engine export (the directory above speculators/)", SRC["sglang_arch"])
        return reading
    try:
        s = draft_shapes(config, config.get("draft_vocab_size"), config.get("target_hidden_size"))
    except KeyError as exc:
        reading.refuse(f"config.json lacks {exc.args[0]}: SGLang cannot build the draft", SRC["sglang_config"])
        return reading
    new = v >= SGLANG_FC_NORM
    eagle_config = config.get("eagle_config") or {}
    norm_before_fc = bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc")))
    _flags(reading, config, {"fc_norm": new, "norm_output": new}, "sglang 0.5.12, PR #24663", SRC["sglang_config"])
    _flags(reading, {"norm_before_fc": norm_before_fc}, {"norm_before_fc": v >= SGLANG_NORM_BEFORE_FC},
           "sglang 0.5.17", SRC["sglang_config"])
    if config.get("tie_word_embeddings"):
        reading.refuse("tie_word_embeddings is true: SGLang makes lm_head the embedding (the verifier's, by "
                       "set_embed), skips the trained lm_head.weight and scores draft tokens with it",
                       SRC["sglang_head"])
    if config.get("draft_vocab_size") is None:
        reading.refuse("no draft_vocab_size: SGLang takes the verifier's lm_head instead of the trained one "
                       "(load_lm_head_from_target)", SRC["sglang_head"])
    if s.layers != 1 and not new:
        reading.refuse(f"{s.layers} decoder layers: SGLang {version} builds one (midlayer)", SRC["sglang_config"])
        return reading

    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list):
        reading.capture_layers = [i + 1 for i in ids]  # outputs of layers: it captures the input of id + 1
        reading.capture_source = "eagle_config.eagle_aux_hidden_state_layer_ids (+1)"
    if config.get("eagle_aux_hidden_state_layer_ids") and not isinstance(ids, list):
        reading.ignored.append("eagle_aux_hidden_state_layer_ids (top level)")
    aux = (config.get("num_aux_hidden_states") or (len(ids) if ids else 3)) if new else 3
    _check_capture(reading, aux, verifier, 1, 1, SRC["sglang_config"], SRC["sglang_capture"])

    fc_norm = bool(config.get("fc_norm") or config.get("use_aux_norm")) and new
    expected = expected_tensors(s, aux, fc_norm, norm_before_fc and v >= SGLANG_NORM_BEFORE_FC, s.target_hidden)
    optional = {"embed_tokens.weight": [s.vocab, s.hidden], "d2t": [s.draft_vocab]}
    if config.get("tie_word_embeddings"):
        expected.pop("lm_head.weight")  # lm_head is the embedding: the file's lm_head.weight is refused as skipped

    def canonical(name: str) -> str | None:
        if not new:  # the layer is the module `midlayer`; `layers.0.*` finds no parameter
            return None if name.startswith("layers.") else name.replace("midlayer.", "layers.0.", 1)
        for legacy, renamed in (("midlayer", "layers.0"), ("aux_norm_low", "fc_norm.0"),
                                ("aux_norm_mid", "fc_norm.1"), ("aux_norm_high", "fc_norm.2")):
            name = name.replace(legacy, renamed)
        return name

    loader = Loader(
        expected=expected, optional=optional, canonical=canonical,
        missing="SGLang leaves that parameter uninitialised (nothing checks that every one was loaded)",
        unknown="SGLang skips it without a word", misshapen="SGLang's weight loader asserts the shape and stops",
        missing_source=SRC["sglang_load"], unknown_source=SRC["sglang_load"], layer0="midlayer.",
    )
    check_tensors(reading, {n: t for n, t in tensors.items() if n != "t2d"}, loader, f"the config ({_sizes(s)})")
    _check_vocab_map(reading, tensors, s, "has no hot-token map and proposes draft ids as target ids",
                     SRC["sglang_d2t"])
    _check_against_verifier(reading, s, verifier, True, s.target_hidden, SRC["sglang_config"])
    return reading


def read_speculators(config: dict, tensors: dict, verifier: Verifier | None, version: str) -> EngineReading:
    reading = EngineReading("speculators", version, rules=_rules("speculators", version))
    if "speculators_model_type" not in config:
        reading.refuse("not speculators' format: its converter would write eagle_aux_hidden_state_layer_ids "
                       "null; train with --export-format speculators and check DIR/speculators", SRC["spec_load"])
        return reading
    layer = config.get("transformer_layer_config") or {}
    try:
        s = draft_shapes(layer, config.get("draft_vocab_size"), None)
    except KeyError as exc:
        reading.refuse(f"transformer_layer_config lacks {exc.args[0]}", SRC["spec_config"])
        return reading
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        reading.capture_layers, reading.capture_source = list(ids), "eagle_aux_hidden_state_layer_ids"
    else:
        reading.capture_layers = default_layers(verifier.num_layers if verifier else None)
        reading.capture_source = "default (2, N/2, N-3)"
    aux = len(ids) if ids else 3
    _check_capture(reading, aux, verifier, 0, 0, SRC["spec_config"], SRC["spec_config"])
    if config.get("tie_word_embeddings") or layer.get("tie_word_embeddings"):
        reading.ignored.append("tie_word_embeddings")
        reading.notes.append("tie_word_embeddings is forced false by speculators (SpeculatorModel.__init__)")
    expected = expected_tensors(s, aux, bool(config.get("fc_norm")), bool(config.get("norm_before_fc")), s.hidden)
    expected["embed_tokens.weight"] = [s.vocab, s.hidden]
    optional = {"d2t": [s.draft_vocab], "t2d": [s.vocab], "verifier_norm.weight": [s.hidden],
                "verifier_lm_head.weight": [s.draft_vocab, s.hidden]}
    loader = Loader(
        expected=expected, optional=optional,
        canonical=lambda n: n,
        missing="from_pretrained initialises it anew with only a warning",
        unknown="from_pretrained drops it with only a warning",
        misshapen="from_pretrained stops on the size mismatch",
        missing_source=SRC["spec_load"], unknown_source=SRC["spec_load"],
        special_missing={
            "embed_tokens.weight": ("speculators' from_pretrained keeps uninitialised memory for the embedding",
                                    SRC["spec_verifier"]),
            "lm_head.weight": ("speculators fills it with the verifier's lm_head rows, not the trained head",
                               SRC["spec_verifier"]),
        },
    )
    check_tensors(reading, tensors, loader, f"transformer_layer_config ({_sizes(s)})")
    _check_vocab_map(reading, tensors, s, "keeps d2t at zeros", SRC["spec_d2t"])
    target = config.get("target_hidden_size")
    if target is not None and target != s.hidden:
        reading.refuse(f"target_hidden_size {target} differs from hidden_size {s.hidden}: speculators' fc reads "
                       "features of hidden_size", SRC["spec_config"])
    _check_against_verifier(reading, s, verifier, "embed_tokens.weight" not in tensors, s.hidden, SRC["spec_config"])
    return reading


READERS = {"vllm": read_vllm, "sglang": read_sglang, "speculators": read_speculators}
CAPTURE_SOURCES = {"vllm": SRC["vllm_capture"], "sglang": SRC["sglang_capture"], "speculators": SRC["spec_config"]}


def _sizes(s: Shapes) -> str:
    return (f"hidden {s.hidden}, target hidden {s.target_hidden}, vocab {s.vocab}, draft vocab {s.draft_vocab}, "
            f"intermediate {s.intermediate}, heads {s.heads}/{s.kv_heads} of {s.head_dim}")


def _rules(engine: str, version: str) -> str:
    """Which release's code the rules for `version` were read from."""
    releases = READ_RELEASES[engine]
    wanted = parse_version(version)
    older = [r for r in releases if parse_version(r) <= wanted]
    if not older:
        return f"{engine} {releases[0]} (the oldest release read; {version} is older)"
    followed = older[-1]
    if followed == releases[-1] and wanted > parse_version(followed):
        return f"{engine} {followed} (the newest release read; {version} is taken to read drafts as it does)"
    return f"{engine} {followed}"


def read(engine: str, config: dict, tensors: dict, verifier: Verifier | None = None,
         version: str | None = None) -> EngineReading:
    """`engine`'s reading of one export (config.json as a dict, the safetensors header) at `version`."""
    return READERS[engine](config, tensors, verifier, version or default_version(engine))
