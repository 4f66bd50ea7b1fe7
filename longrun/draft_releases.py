"""What each engine release does with an EAGLE-3 draft, as facts read from its wheel, each with the file it was read
from. longrun/draft_engines.py applies them; a release between two read ones follows the older, and a release newer
than the newest read (or older than the oldest) is reported as unverified, never assumed.

vLLM (wheels of 0.21.0, 0.22.0, 0.23.0, 0.24.0, 0.25.0, 0.26.0, 0.27.0, 0.28.0, 0.29.0, 0.30.0, 0.34.0 unpacked):
- model_executor/models/llama_eagle3.py: the draft it builds from config.json and how load_weights maps names
  (`midlayer.` -> `layers.0.`, q/k/v and gate/up stacked, `t2d` dropped, `d2t` -> draft_id_to_target_id, a name
  without `lm_head` gets `model.` put before it, so `model.fc.weight` becomes `model.model.fc.weight`: unknown);
  models/utils.py AutoWeightsLoader: an unknown name stops the load ("There is no module or parameter named ...");
- 0.22.0 (PR #42764): `fc_norm`, `norm_output`, `norm_before_fc` also from `eagle_config`, fc reads
  len(eagle_config.eagle_aux_hidden_state_layer_ids) features (else 3); llama_eagle3.py reads
  `norm_before_residual` in every release read (LlamaDecoderLayer.__init__: `_norm_before_residual`);
- 0.25.0 (PR #46488): transformers_utils/configs/speculators/algos.py passes fc_norm / norm_output on;
- 0.30.0: Eagle3LlamaForCausalLM.__init__ builds draft_id_to_target_id only `if draft_vocab_size !=
  target_vocab_size` (the verifier's, model_config.get_vocab_size()); a `d2t` in a draft of the full vocabulary is
  renamed to that missing parameter and AutoWeightsLoader stops the load. 0.28.0 and 0.29.0 still build it;
- capture layers: the V1 runner (v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config) reads the
  top-level `eagle_aux_hidden_state_layer_ids`, from 0.22.0 else `eagle_config.eagle_aux_hidden_state_layer_ids`,
  both as inputs of layers; the V2 runner (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
  get_eagle3_aux_layers_from_config) reads the top-level key, from 0.25.0 `target_layer_ids` (+1), from 0.27.0
  `eagle_config.layer_ids`, never `eagle_config.eagle_aux_hidden_state_layer_ids`; without ids both take
  models/interfaces.py get_eagle3_default_aux_hidden_state_layers: (2, N // 2, N - 3). Which runner serves
  (config/vllm.py use_v2_model_runner and _is_default_v2_model_runner_model, VLLM_USE_V2_MODEL_RUNNER unset; MoE
  is model_config.is_moe: num_experts, moe_num_experts, n_routed_experts or num_local_experts in the verifier's
  config): 0.21.0 V1 (envs.py: off); 0.22.0 and 0.23.0 V2 for a listed architecture (0.22.0: Qwen3ForCausalLM;
  0.23.0: also Llama and Mistral) that is neither MoE nor quantized; 0.24.0 for a listed one; 0.25.0 to 0.28.0 for
  a listed one or any verifier that is not MoE; from 0.29.0 for every verifier on CUDA; 0.34.0 ships no V1;
- RoPE: models/llama.py LlamaAttention get_rope(rope_parameters) after transformers_utils/config.py
  patch_rope_parameters: the draft's own rope_theta / rope_scaling / rope_parameters, transformers' LlamaConfig
  default (rope_theta 10000, no scaling) where it has none.

SGLang (wheels of 0.5.11, 0.5.12, 0.5.16, 0.5.17, 0.5.23 unpacked):
- srt/models/llama_eagle3.py load_weights: each name loads `if param_name in params_dict` (the name, else `model.`
  + name: `model.fc.weight` loads), anything else is skipped without a word; `d2t` -> hot_token_id = d2t +
  arange(len) with no dtype cast: a float d2t makes a float index and the first draft step fails (speculative/
  eagle_worker_v2.py indexes with it); `tie_word_embeddings` makes lm_head the embedding; no `draft_vocab_size`
  takes the verifier's lm_head (load_lm_head_from_target);
- LlamaDecoderLayer.forward keeps the residual before hidden_norm in every release read: `norm_before_residual`
  is never read;
- before 0.5.12 the layer is `midlayer` only; 0.5.12 (PR #24663): `layers.N`, fc_norm / norm_output, fc count
  from eagle_config; 0.5.17: norm_before_fc;
- capture layers: model_executor/model_runner.py (0.5.23: model_runner_components/spec_aux_hidden_state.py) reads
  `eagle_config.eagle_aux_hidden_state_layer_ids` only; models/llama.py set_eagle3_layers_to_capture captures the
  input of id + 1, or (2, N // 2, N - 3) without ids;
- RoPE: LlamaModel.__init__ / LlamaAttention: the draft's rope_parameters, else rope_scaling and rope_theta.

speculators 0.9.0 (installed): models/eagle3/config.py (norm_before_residual default false), core.py, model.py.

"""

from dataclasses import dataclass

from server.advisor.releases import nearest_read, parse_version  # noqa: F401 (check-draft reads versions so)


@dataclass(frozen=True)
class VllmRelease:
    fc_norm: bool  # fc_norm / norm_output / eagle_config's count read in the engine format
    speculators_fc_norm: bool  # the same passed on from speculators' format
    v1_eagle_config_ids: bool  # the V1 runner falls back to eagle_config.eagle_aux_hidden_state_layer_ids
    v2_layer_ids: bool  # the V2 runner falls back to eagle_config.layer_ids
    v2_target_layer_ids: bool  # the V2 runner reads target_layer_ids (+1)
    v2_default: str  # when V2 serves (config/vllm.py use_v2_model_runner, VLLM_USE_V2_MODEL_RUNNER unset):
    # "never"; "listed_dense": a listed verifier architecture, not MoE, not quantized; "listed"; "listed_or_dense":
    # a listed architecture or any verifier that is not MoE; "always" (CUDA)
    v1_gone: bool  # no V1 runner ships
    full_vocab_d2t_fails: bool  # no draft_id_to_target_id where draft vocab == target vocab
    v2_architectures: frozenset = frozenset()  # DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES


V2_022 = frozenset({"Qwen3ForCausalLM"})
V2_023 = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"})
V2_024 = V2_023 | {"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"}
V2_025 = frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"})
V2_026 = V2_025 | {"InklingForCausalLM", "InklingForConditionalGeneration", "LongcatFlashNgramForCausalLM"}
V2_027 = V2_026 | {"KimiK3ForConditionalGeneration"}
VLLM = {  # release read -> what it does
    "0.21.0": VllmRelease(False, False, False, False, False, "never", False, False),
    "0.22.0": VllmRelease(True, False, True, False, False, "listed_dense", False, False, V2_022),
    "0.23.0": VllmRelease(True, False, True, False, False, "listed_dense", False, False, V2_023),
    "0.24.0": VllmRelease(True, False, True, False, False, "listed", False, False, V2_024),
    "0.25.0": VllmRelease(True, True, True, False, True, "listed_or_dense", False, False, V2_025),
    "0.26.0": VllmRelease(True, True, True, False, True, "listed_or_dense", False, False, V2_026),
    "0.27.0": VllmRelease(True, True, True, True, True, "listed_or_dense", False, False, V2_027),
    "0.28.0": VllmRelease(True, True, True, True, True, "listed_or_dense", False, False,
                          V2_027 | {"DeepseekV4ForCausalLM"}),
    "0.29.0": VllmRelease(True, True, True, True, True, "always", False, False),
    "0.30.0": VllmRelease(True, True, True, True, True, "always", False, True),
    "0.34.0": VllmRelease(True, True, True, True, True, "always", True, True),
}


@dataclass(frozen=True)
class SglangRelease:
    layers_names: bool  # `layers.N` names and legacy renames (else `midlayer` only)
    fc_norm: bool  # fc_norm / norm_output / eagle_config's count
    norm_before_fc: bool


SGLANG = {
    "0.5.11": SglangRelease(False, False, False),
    "0.5.12": SglangRelease(True, True, False),
    "0.5.16": SglangRelease(True, True, False),
    "0.5.17": SglangRelease(True, True, True),
    "0.5.23": SglangRelease(True, True, True),
}
SPECULATORS = {"0.9.0": None}


RELEASES = {"vllm": VLLM, "sglang": SGLANG, "speculators": SPECULATORS}
READ_RELEASES = {engine: tuple(table) for engine, table in RELEASES.items()}

SRC = {
    "vllm_load": "vllm {v} llama_eagle3.py Eagle3LlamaForCausalLM.load_weights + utils.py AutoWeightsLoader",
    "vllm_missing": "vllm {v} llama_eagle3.py load_weights returns None, default_loader.py skips "
                    "track_weights_loading",
    "vllm_lm_head": "vllm {v} v1/spec_decode/eagle.py load_model (has_own_lm_head)",
    "vllm_d2t": "vllm {v} llama_eagle3.py load_weights (d2t) and compute_logits",
    "vllm_d2t_full": "vllm {v} llama_eagle3.py Eagle3LlamaForCausalLM.__init__ (draft_id_to_target_id = None when "
                     "draft_vocab_size == target_vocab_size) + utils.py AutoWeightsLoader",
    "vllm_config": "vllm {v} llama_eagle3.py LlamaModel.__init__",
    "vllm_residual": "vllm {v} llama_eagle3.py LlamaDecoderLayer.__init__ (norm_before_residual)",
    "vllm_capture_v1": "vllm {v} v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config",
    "vllm_capture_v2": "vllm {v} v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config",
    "vllm_runner": "vllm {v} config/vllm.py use_v2_model_runner (_is_default_v2_model_runner_model)",
    "vllm_range": "vllm {v} models/llama.py LlamaModel.forward (_maybe_add_hidden_state at 0..N)",
    "vllm_algos": "vllm {v} transformers_utils/configs/speculators/algos.py update_eagle3",
    "vllm_rope": "vllm {v} models/llama.py LlamaAttention get_rope + transformers_utils/config.py "
                 "patch_rope_parameters",
    "sglang_load": "sglang {v} models/llama_eagle3.py LlamaForCausalLMEagle3.load_weights "
                   "(if param_name in params_dict)",
    "sglang_config": "sglang {v} models/llama_eagle3.py LlamaModel.__init__",
    "sglang_residual": "sglang {v} models/llama_eagle3.py LlamaDecoderLayer.forward (residual before hidden_norm)",
    "sglang_head": "sglang {v} models/llama_eagle3.py LlamaForCausalLMEagle3.__init__ (tie_word_embeddings, "
                   "draft_vocab_size)",
    "sglang_d2t": "sglang {v} models/llama_eagle3.py load_weights (hot_token_id = d2t + arange)",
    "sglang_d2t_dtype": "sglang {v} models/llama_eagle3.py load_weights (hot_token_id = d2t + arange, no cast) + "
                        "speculative/eagle_worker_v2.py (hot_token_id indexes the draft's top-k)",
    "sglang_capture": "sglang {v} model_runner (eagle_config ids) + models/llama.py set_eagle3_layers_to_capture",
    "sglang_arch": "sglang {v} models/llama_eagle3.py EntryClass",
    "sglang_rope": "sglang {v} models/llama_eagle3.py LlamaModel.__init__ (rope_parameters, else rope_scaling)",
    "spec_load": "speculators {v} models/eagle3/core.py Eagle3DraftModel (transformers from_pretrained)",
    "spec_verifier": "speculators {v} model.py _load_verifier_weights (NaN checks)",
    "spec_config": "speculators {v} models/eagle3/core.py Eagle3DraftModel.__init__",
    "spec_d2t": "speculators {v} model.py DraftVocabMixin._init_vocab (d2t zeros)",
    "spec_residual": "speculators {v} models/eagle3/config.py (norm_before_residual, default false)",
    "spec_rope": "speculators {v} models/eagle3/core.py (transformer_layer_config's RoPE)",
}
UNVERIFIED_SOURCE = "longrun/draft_releases.py (the releases read)"


def default_version(engine: str) -> str:
    return READ_RELEASES[engine][-1]


def followed(engine: str, version: str) -> tuple[str, str | None]:
    """(the release whose rules apply to `version`, why they are unverified for it or None)."""
    release, outside = nearest_read(READ_RELEASES[engine], version)
    if outside < 0:
        return release, (f"{engine} {version} is older than the oldest release read ({release}): its rules "
                         "are unverified")
    if outside > 0:
        return release, (f"{engine} {version} is newer than the newest release read ({release}): how it reads a "
                         f"draft is unverified (check with --engine-version {release} to apply {release}'s rules)")
    return release, None
