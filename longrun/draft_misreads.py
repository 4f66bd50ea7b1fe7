"""What no engine's loader stops and yet makes it run another draft than the one trained, wherever the files show
it: the draft's RoPE against the verifier's and the training config's, `norm_before_residual` against what its
trainer did, and the verifier layers the engine captures against those the draft was trained on.

Who trained a draft decides what it was trained with:
- longrun (its config carries `aux_hidden_state_layer_ids` and `ttt_steps`): the verifier's RoPE, the residual kept
  before hidden_norm (norm_before_residual false), the inputs of `aux_hidden_state_layer_ids`;
- speculators' format (`speculators_model_type`): what its config says; speculators 0.9.0 reads
  norm_before_residual itself (models/eagle3/config.py, default false);
- any other engine-format draft (SpecForge 0.2.0 modeling/draft/llama3_eagle.py LlamaDecoderLayer.forward, SafeAILab's
  cnets.py): norm_before_residual is not read in training (the residual is kept before hidden_norm); capture layers
  are `eagle_config.eagle_aux_hidden_state_layer_ids` as outputs of layers, or without them the verifier's
  default (SpecForge 0.2.0 algorithms/model_providers.py: outputs of [1, N // 2 - 1, N - 4], the inputs of
  (2, N // 2, N - 3)); a top-level `eagle_aux_hidden_state_layer_ids` is taken as inputs of layers (vLLM's key).
"""

from longrun.draft_rules import EngineReading, Verifier, default_layers, rope_of

DEFAULT = "the verifier's default (2, N/2, N-3)"


def _rope_text(rope: tuple) -> str:
    theta, scaling = rope
    if scaling is None:
        return f"rope_theta {theta:g}, no scaling"
    return f"rope_theta {theta:g}, {scaling[0]} scaling " + ", ".join(f"{k} {v}" for k, v in scaling[1:])


LONGRUN_SCALINGS = ("linear", "llama3", "yarn")  # trainer/model.py DraftConfig.from_verifier: others train unscaled


def check_rope(reading: EngineReading, layer_config: dict, verifier: Verifier | None, training: dict | None,
               source: str, longrun: bool = False) -> None:
    """The RoPE the engine builds for the draft against the training config's (longrun's last checkpoint, or its
    engine export beside its speculators/ export) or else the verifier's, which longrun and SpecForge's stock
    configs copy (`longrun`: as longrun copies it, a scaling of another type than LONGRUN_SCALINGS dropped)."""
    built = rope_of(layer_config)
    if training is not None and rope_of(training) != built:
        reading.refuse(f"{reading.engine} builds the draft's RoPE as {_rope_text(built)} but it was trained with "
                       f"{_rope_text(rope_of(training))} (the training config): every position would be rotated "
                       "otherwise than in training", source)
    elif training is None and verifier is not None and verifier.rope is not None:
        theta, scaling = verifier.rope
        trained = (theta, None) if longrun and scaling and scaling[0] not in LONGRUN_SCALINGS else verifier.rope
        if trained != built:
            reading.refuse(f"{reading.engine} builds the draft's RoPE as {_rope_text(built)}; the verifier's is "
                           f"{_rope_text(verifier.rope)}, which the draft is trained with: every position would be "
                           "rotated otherwise than in training", source)


def trainer_of(config: dict) -> str:
    if "speculators_model_type" in config:
        return "speculators"
    if "aux_hidden_state_layer_ids" in config and "ttt_steps" in config:
        return "longrun"
    return "other"


def trained_residual(config: dict) -> bool:
    """Whether the draft was trained with hidden_norm before the residual (norm_before_residual true)."""
    if trainer_of(config) == "speculators":
        return bool(config.get("norm_before_residual", False))
    return False  # longrun, SpecForge 0.2.0, SafeAILab: the residual is kept before hidden_norm, whatever the key


def check_residual(reading: EngineReading, config: dict, served: bool, source: str) -> None:
    """`served`: whether the engine applies hidden_norm before the residual for this config."""
    trained = trained_residual(config)
    if served == trained:
        if config.get("norm_before_residual") and not served:
            reading.ignored.append("norm_before_residual")
        return
    who = {"speculators": "speculators' config", "longrun": "longrun"}.get(trainer_of(config),
                                                                            "its trainer (SpecForge, EAGLE)")
    reading.refuse(f"{reading.engine} {reading.version} runs hidden_norm {'before' if served else 'after'} the "
                   f"residual (norm_before_residual {str(served).lower()}) but {who} trained it "
                   f"{'before' if trained else 'after'}: another draft than the one trained", source)


def trained_layers(config: dict, parent: dict | None = None) -> tuple[list[int] | None, str]:
    """(the inputs of the verifier layers the draft was trained on, or None for the verifier's default; where that is
    read). `parent`: the engine export's config beside a speculators/ export (longrun's training record)."""
    for record in (config, parent or {}):
        ids = record.get("aux_hidden_state_layer_ids")
        if isinstance(ids, list) and "ttt_steps" in record:
            return list(ids), "longrun's aux_hidden_state_layer_ids"
    top = config.get("eagle_aux_hidden_state_layer_ids")
    eagle = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if isinstance(top, list) and top:
        return list(top), "eagle_aux_hidden_state_layer_ids"
    if isinstance(eagle, list) and eagle:
        return [i + 1 for i in eagle], "eagle_config.eagle_aux_hidden_state_layer_ids (outputs of layers)"
    return None, DEFAULT


def check_layers(reading: EngineReading, config: dict, parent: dict | None, verifier: Verifier | None,
                 source: str) -> None:
    """The layers the engine captures against those the draft was trained on. Both the verifier's default: right
    whatever the verifier; one of them the default: compared where --verifier gives the layer count."""
    trained, where = trained_layers(config, parent)
    captured = reading.capture_layers
    count = verifier.num_layers if verifier else None
    if trained is None and reading.capture_default:
        return
    if trained is None:
        trained = default_layers(count)
    if trained is None or captured is None:
        reading.refuse(f"{reading.engine} captures {reading.capture_source or DEFAULT} and the draft was trained on "
                       f"{trained or DEFAULT} ({where}): pass --verifier to compare them", source)
        return
    if captured != trained:
        reading.refuse(f"{reading.engine} captures layers {captured} ({reading.capture_source}) but the draft was "
                       f"trained on {trained} ({where})", source)
