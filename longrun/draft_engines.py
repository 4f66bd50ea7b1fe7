"""How vLLM, SGLang and speculators read an exported EAGLE-3 draft at a release: which config keys each reads, the
parameters it builds from them, what it does with each tensor name (loads it, remaps it, skips it, fails), which
verifier layers it captures, and what it would misread. Every refusal names the loader code it mirrors; the facts
per release, and the file and release each was read from, are longrun/draft_releases.py.

Architectures: vLLM and SGLang load `LlamaForCausalLMEagle3` drafts (vLLM also speculators' format), speculators
its own format only.
"""

from longrun.draft_misreads import check_layers, check_residual, check_rope, trainer_of
from longrun.draft_releases import (
    RELEASES,
    SRC,
    UNVERIFIED_SOURCE,
    VllmRelease,
    default_version,
    followed,
)
from longrun.draft_rules import (
    INTEGER_DTYPES,
    SGLANG_ARCHITECTURE,
    EngineReading,
    Loader,
    Verifier,
    check_against_verifier,
    check_capture,
    check_flags,
    check_tensors,
    check_vocab_map,
    default_layers,
    draft_shapes,
    expected_tensors,
    sizes,
)


def _capture(reading: EngineReading, ids, source: str, verifier: Verifier | None) -> None:
    """Set the layers the engine captures: `ids` (inputs of layers) or, for None, the verifier's default."""
    if ids:
        reading.capture_layers, reading.capture_source = list(ids), source
    else:
        reading.capture_default = True
        reading.capture_layers = default_layers(verifier.num_layers) if verifier else None
        reading.capture_source = "the verifier's default (2, N/2, N-3)"


def _vllm_runner(release: VllmRelease, verifier: Verifier | None) -> str | None:
    """The model runner vLLM serves with by default (VLLM_USE_V2_MODEL_RUNNER unset; config/vllm.py), or None where
    that depends on the verifier and there is none."""
    rule = release.v2_default
    if rule in ("never", "always"):
        return "v2" if rule == "always" else "v1"
    if verifier is None:
        return None
    listed = bool(set(verifier.architectures) & release.v2_architectures)
    v2 = {"listed_dense": listed and not verifier.moe and not verifier.quantized, "listed": listed,
          "listed_or_dense": listed or not verifier.moe}[rule]
    return "v2" if v2 else "v1"


def _vllm_ids(config: dict, release: VllmRelease, runner: str) -> tuple[list[int] | None, str]:
    """The layer ids vLLM's runner reads from the draft's config (inputs of layers), and the key."""
    eagle_config = config.get("eagle_config") or {}
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids and isinstance(ids, list):
        return ids, "eagle_aux_hidden_state_layer_ids"
    if runner == "v1":
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if release.v1_eagle_config_ids else None
        return (ids, "eagle_config.eagle_aux_hidden_state_layer_ids") if isinstance(ids, list) and ids else (None, "")
    target = config.get("target_layer_ids")
    if release.v2_target_layer_ids and isinstance(target, list) and target:
        return [i + 1 for i in target], "target_layer_ids (+1)"
    ids = eagle_config.get("layer_ids") if release.v2_layer_ids else None
    return (ids, "eagle_config.layer_ids") if isinstance(ids, list) and ids else (None, "")


def read_vllm(config: dict, tensors: dict, verifier: Verifier | None, version: str, release: VllmRelease,
              parent: dict | None = None, training: dict | None = None) -> EngineReading:
    reading = EngineReading("vllm", version)
    speculators = "speculators_model_type" in config
    eagle_config = config.get("eagle_config") or {}
    layer = (config.get("transformer_layer_config") or {}) if speculators else config
    try:
        s = draft_shapes(layer, config.get("draft_vocab_size"), config.get("target_hidden_size"))
    except KeyError as exc:
        reading.refuse(f"config.json lacks {exc.args[0]}: vLLM cannot build the draft", SRC["vllm_config"])
        return reading
    reads_31 = release.speculators_fc_norm if speculators else release.fc_norm
    flags_source = SRC["vllm_algos"] if speculators else SRC["vllm_config"]
    norm_before_fc = bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc")))
    needs = "vllm 0.25.0 in speculators' format, PR #46488" if speculators else "vllm 0.22.0, PR #42764"
    check_flags(reading, config, {"fc_norm": reads_31, "norm_output": reads_31}, needs, flags_source)
    # speculators' format: algos.py passes norm_before_residual on, true where the config has none
    served = bool(config.get("norm_before_residual", True)) if speculators else bool(
        config.get("norm_before_residual"))
    check_residual(reading, config, served, SRC["vllm_algos"] if speculators else SRC["vllm_residual"])
    if config.get("tie_word_embeddings") or layer.get("tie_word_embeddings"):
        reading.ignored.append("tie_word_embeddings")
        reading.notes.append("tie_word_embeddings is not read: vLLM loads the draft's own lm_head.weight")

    runner = _vllm_runner(release, verifier)
    readings = {r: _vllm_ids(config, release, r) for r in ("v1", "v2") if not (r == "v1" and release.v1_gone)}
    if runner is None and len({str(ids) for ids, _ in readings.values()}) > 1:
        reading.refuse(f"vllm {version} captures {readings['v1'][0]} with its V1 model runner and "
                       f"{readings['v2'][0] or 'the default layers'} with V2, and which one serves depends on the "
                       "verifier's architecture: pass --verifier", SRC["vllm_runner"])
    ids, source = readings[runner or "v1"]
    _capture(reading, ids, source, verifier)
    if runner is not None:
        other = "v2" if runner == "v1" else "v1"
        if other in readings and readings[other][0] != ids:
            reading.notes.append(f"the {other.upper()} model runner (VLLM_USE_V2_MODEL_RUNNER={int(other == 'v2')}) "
                                 f"would capture {readings[other][0] or 'the default layers'} instead")
        reading.notes.append(f"serves with the {runner.upper()} model runner (vllm {version} config/vllm.py "
                             "use_v2_model_runner)")
    if release.fc_norm and not speculators:
        counted = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        aux = config.get("num_aux_hidden_states") or (len(counted) if counted else 3)
    else:
        aux = 3
    capture_source = SRC["vllm_capture_v2" if runner == "v2" else "vllm_capture_v1"]  # None: both disagree above
    check_capture(reading, aux, verifier, 0, 0, SRC["vllm_config"], SRC["vllm_range"])
    check_layers(reading, config, parent, verifier, capture_source)
    check_rope(reading, layer, verifier, training, SRC["vllm_rope"], _by_longrun(config, parent))

    fc_norm = bool(config.get("fc_norm")) and reads_31
    expected = expected_tensors(s, aux, fc_norm, norm_before_fc, s.target_hidden)
    optional = {"embed_tokens.weight": [s.vocab, s.hidden], "d2t": [s.draft_vocab]}
    target_vocab = verifier.vocab_size if verifier and verifier.vocab_size else s.vocab
    if release.full_vocab_d2t_fails and "d2t" in tensors and s.draft_vocab == target_vocab:
        reading.refuse(f"d2t in a draft of the verifier's whole vocabulary ({s.draft_vocab}): vllm {version} builds "
                       "no draft_id_to_target_id then and stops at load (ValueError: There is no module or "
                       "parameter named 'draft_id_to_target_id'); drop d2t and t2d", SRC["vllm_d2t_full"])
        optional.pop("d2t")
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
    if "d2t" not in optional:
        dropped.add("d2t")  # refused above
    check_tensors(reading, {n: t for n, t in tensors.items() if n not in dropped}, loader,
                  f"{'transformer_layer_config' if speculators else 'the config'} ({sizes(s)})")
    check_vocab_map(reading, tensors, s, "keeps a zero draft-to-target map and proposes draft ids as target ids",
                    SRC["vllm_d2t"])
    check_against_verifier(reading, s, verifier, "embed_tokens.weight" not in tensors, s.target_hidden,
                           SRC["vllm_config"])
    return reading


def _by_longrun(config: dict, parent: dict | None) -> bool:
    return trainer_of(config) == "longrun" or (parent is not None and trainer_of(parent) == "longrun")


def _sglang_canonical(name: str, layers_names: bool) -> str | None:
    """The parameter SGLang loads `name` into (named as the file would: no `model.`), or None where it skips it.
    load_weights tries the name, then `model.` + name: `model.fc.weight` and `fc.weight` both load."""
    if name.startswith("model.") and not name.startswith("model.lm_head"):
        name = name.removeprefix("model.")
    if not layers_names:  # the layer is the module `midlayer`; `layers.0.*` finds no parameter
        return None if name.startswith("layers.") else name.replace("midlayer.", "layers.0.", 1)
    for legacy, renamed in (("midlayer", "layers.0"), ("aux_norm_low", "fc_norm.0"), ("aux_norm_mid", "fc_norm.1"),
                            ("aux_norm_high", "fc_norm.2")):
        name = name.replace(legacy, renamed)
    return name


def read_sglang(config: dict, tensors: dict, verifier: Verifier | None, version: str, release,
                parent: dict | None = None, training: dict | None = None) -> EngineReading:
    reading = EngineReading("sglang", version)
    if "speculators_model_type" in config or SGLANG_ARCHITECTURE not in (config.get("architectures") or []):
        reading.refuse(f"SGLang loads {SGLANG_ARCHITECTURE} drafts, not {config.get('architectures')}: "
                       "serve the engine export (the directory above speculators/)", SRC["sglang_arch"])
        return reading
    try:
        s = draft_shapes(config, config.get("draft_vocab_size"), config.get("target_hidden_size"))
    except KeyError as exc:
        reading.refuse(f"config.json lacks {exc.args[0]}: SGLang cannot build the draft", SRC["sglang_config"])
        return reading
    new = release.fc_norm
    eagle_config = config.get("eagle_config") or {}
    norm_before_fc = bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc")))
    check_flags(reading, config, {"fc_norm": new, "norm_output": new}, "sglang 0.5.12, PR #24663",
                SRC["sglang_config"])
    check_flags(reading, {"norm_before_fc": norm_before_fc}, {"norm_before_fc": release.norm_before_fc},
                "sglang 0.5.17", SRC["sglang_config"])
    check_residual(reading, config, False, SRC["sglang_residual"])
    if config.get("tie_word_embeddings"):
        reading.refuse("tie_word_embeddings is true: SGLang makes lm_head the embedding (the verifier's, by "
                       "set_embed), skips the trained lm_head.weight and scores draft tokens with it",
                       SRC["sglang_head"])
    if config.get("draft_vocab_size") is None:
        reading.refuse("no draft_vocab_size: SGLang takes the verifier's lm_head instead of the trained one "
                       "(load_lm_head_from_target)", SRC["sglang_head"])
    if s.layers != 1 and not release.layers_names:
        reading.refuse(f"{s.layers} decoder layers: SGLang {version} builds one (midlayer)", SRC["sglang_config"])
        return reading
    dtype = (tensors.get("d2t") or ("I64", []))[0]
    if dtype not in INTEGER_DTYPES:
        reading.refuse(f"d2t is {dtype}: SGLang adds it to arange() without a cast, and the float hot_token_id it "
                       "makes fails as an index at the first draft step; write d2t as int64", SRC["sglang_d2t_dtype"])

    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    _capture(reading, [i + 1 for i in ids] if isinstance(ids, list) and ids else None,
             "eagle_config.eagle_aux_hidden_state_layer_ids (+1)", verifier)
    if config.get("eagle_aux_hidden_state_layer_ids") and not (isinstance(ids, list) and ids):
        reading.ignored.append("eagle_aux_hidden_state_layer_ids (top level)")
    aux = (config.get("num_aux_hidden_states") or (len(ids) if ids else 3)) if new else 3
    check_capture(reading, aux, verifier, 1, 1, SRC["sglang_config"], SRC["sglang_capture"])
    check_layers(reading, config, parent, verifier, SRC["sglang_capture"])
    check_rope(reading, config, verifier, training, SRC["sglang_rope"], _by_longrun(config, parent))

    fc_norm = bool(config.get("fc_norm") or config.get("use_aux_norm")) and new
    expected = expected_tensors(s, aux, fc_norm, norm_before_fc and release.norm_before_fc, s.target_hidden)
    optional = {"embed_tokens.weight": [s.vocab, s.hidden], "d2t": [s.draft_vocab]}
    if config.get("tie_word_embeddings"):
        expected.pop("lm_head.weight")  # lm_head is the embedding: the file's lm_head.weight is refused as skipped
    loader = Loader(
        expected=expected, optional=optional, canonical=lambda n: _sglang_canonical(n, release.layers_names),
        missing="SGLang leaves that parameter uninitialised (nothing checks that every one was loaded)",
        unknown="SGLang skips it without a word", misshapen="SGLang's weight loader asserts the shape and stops",
        missing_source=SRC["sglang_load"], unknown_source=SRC["sglang_load"], layer0="midlayer.",
    )
    check_tensors(reading, {n: t for n, t in tensors.items() if n != "t2d"}, loader, f"the config ({sizes(s)})")
    check_vocab_map(reading, tensors, s, "has no hot-token map and proposes draft ids as target ids",
                    SRC["sglang_d2t"])
    check_against_verifier(reading, s, verifier, True, s.target_hidden, SRC["sglang_config"])
    return reading


def read_speculators(config: dict, tensors: dict, verifier: Verifier | None, version: str, release,
                     parent: dict | None = None, training: dict | None = None) -> EngineReading:
    reading = EngineReading("speculators", version)
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
    _capture(reading, ids if isinstance(ids, list) else None, "eagle_aux_hidden_state_layer_ids", verifier)
    aux = len(ids) if ids else 3
    check_capture(reading, aux, verifier, 0, 0, SRC["spec_config"], SRC["spec_config"])
    check_layers(reading, config, parent, verifier, SRC["spec_config"])
    check_residual(reading, config, bool(config.get("norm_before_residual", False)), SRC["spec_residual"])
    check_rope(reading, layer, verifier, training, SRC["spec_rope"], _by_longrun(config, parent))
    if config.get("tie_word_embeddings") or layer.get("tie_word_embeddings"):
        reading.ignored.append("tie_word_embeddings")
        reading.notes.append("tie_word_embeddings is forced false by speculators (SpeculatorModel.__init__)")
    expected = expected_tensors(s, aux, bool(config.get("fc_norm")), bool(config.get("norm_before_fc")), s.hidden)
    expected["embed_tokens.weight"] = [s.vocab, s.hidden]
    optional = {"d2t": [s.draft_vocab], "t2d": [s.vocab], "verifier_norm.weight": [s.hidden],
                "verifier_lm_head.weight": [s.draft_vocab, s.hidden]}
    loader = Loader(
        expected=expected, optional=optional, canonical=lambda n: n,
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
    check_tensors(reading, tensors, loader, f"transformer_layer_config ({sizes(s)})")
    check_vocab_map(reading, tensors, s, "keeps d2t at zeros", SRC["spec_d2t"])
    target = config.get("target_hidden_size")
    if target is not None and target != s.hidden:
        reading.refuse(f"target_hidden_size {target} differs from hidden_size {s.hidden}: speculators' fc reads "
                       "features of hidden_size", SRC["spec_config"])
    check_against_verifier(reading, s, verifier, "embed_tokens.weight" not in tensors, s.hidden, SRC["spec_config"])
    return reading


READERS = {"vllm": read_vllm, "sglang": read_sglang, "speculators": read_speculators}


def read(engine: str, config: dict, tensors: dict, verifier: Verifier | None = None, version: str | None = None,
         parent: dict | None = None, training: dict | None = None) -> EngineReading:
    """`engine`'s reading of one export (config.json as a dict, the safetensors header) at `version` (default: the
    newest release read). `parent`: the config of the engine export a speculators/ export sits in; `training`: the
    config the draft was trained with where the files keep it (its RoPE is compared)."""
    version = version or default_version(engine)
    rules, unverified = followed(engine, version)
    reading = READERS[engine](config, tensors, verifier, version, RELEASES[engine][rules], parent, training)
    reading.rules = f"{engine} {rules}" + (f" (the release read nearest to {version})" if rules != version else "")
    if unverified:
        reading.unverified = unverified
        reading.refuse(unverified, UNVERIFIED_SOURCE)
    return reading
