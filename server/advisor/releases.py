"""Which verifiers vLLM serves an EAGLE-3 draft for (server/advisor/engine.py applies them), VLLM_EAGLE3, from the
wheels of every minor release 0.11.0 to 0.34.0:
- 0.11.0 to 0.16.0: config/speculative.py SpeculativeConfig `eagle3_target_supported`, a substring match on the
  target's hf_text_config.model_type: any other target is a ValueError at start-up ("llama", "qwen", "minicpm",
  "gpt_oss"; 0.16.0 adds hunyuan_vl, hunyuan_v1_dense, afmoe). 0.17.0 drops the list;
- in every release read the model runner also stops (RuntimeError "Model does not support EAGLE3 interface") where
  the target's model class does not implement SupportsEagle3 (v1/worker/gpu_model_runner.py, from 0.17.0 also
  v1/worker/gpu/spec_decode/eagle/eagle3_utils.py set_eagle3_aux_hidden_state_layers, 0.34.0 only that one; the
  class: the verifier's `architectures` through model_executor/models/registry.py). Read for EAGLE3_CHECKED only:
  DeepseekV2ForCausalLM, DeepseekV3ForCausalLM (Kimi-K2) and KimiK25ForConditionalGeneration (Kimi-K2.5, registered
  from 0.15.0) implement it from 0.18.0 (models/deepseek_v2.py, kimi_k25.py), Qwen3MoeForCausalLM from 0.12.0,
  MiniMaxM2ForCausalLM from 0.20.0, Qwen3NextForCausalLM from 0.24.0, Glm4MoeForCausalLM in none; the Llama,
  Mistral, Qwen2, Qwen3 and gpt-oss classes in all.

The release lookup (`parse_version`, `nearest_read`) is shared with check-draft's rules (longrun/draft_releases.py),
which read the same wheels for how each release loads a draft.
"""

import re
from dataclasses import dataclass


def parse_version(text: str) -> tuple[int, ...]:
    """'0.22.0', 'v0.22', '0.5.12.post1', '0.25.0rc1' -> (0, 22, 0) ...: the release's numbers."""
    match = re.match(r"^v?(\d+(?:\.\d+)*)", text.strip())
    if not match:
        raise ValueError(f"not a version: {text!r} (e.g. 0.22.0)")
    numbers = tuple(int(n) for n in match.group(1).split("."))
    return numbers + (0,) * (3 - len(numbers))


def nearest_read(releases: tuple[str, ...], version: str) -> tuple[str, int]:
    """(the release read whose facts apply to `version`: the newest at or before it, else the oldest; -1 where
    `version` is older than every release read, 1 where newer than every one, else 0)."""
    wanted = parse_version(version)
    if wanted < parse_version(releases[0]):
        return releases[0], -1
    release = [r for r in releases if parse_version(r) <= wanted][-1]
    return release, int(release == releases[-1] and wanted > parse_version(release))


@dataclass(frozen=True)
class VllmEagle3:
    model_types: tuple[str, ...] | None  # eagle3_target_supported: substrings of the target's model_type; None: none
    without_interface: frozenset  # those of EAGLE3_CHECKED whose class lacks SupportsEagle3 (or is not registered)
    source: str  # the files (and lines) of the checks in this release


EAGLE3_CHECKED = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration", "LlamaForCausalLM",
    "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
    "Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM"})
LISTED_011 = ("llama", "qwen", "minicpm", "gpt_oss")
LISTED_016 = LISTED_011 + ("hunyuan_vl", "hunyuan_v1_dense", "afmoe")
MLA_KIMI = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"})
LACK_017 = MLA_KIMI | {"Glm4MoeForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM"}
LACK_018 = LACK_017 - MLA_KIMI
LACK_020 = LACK_018 - {"MiniMaxM2ForCausalLM"}
LACK_024 = LACK_020 - {"Qwen3NextForCausalLM"}
RUNNER, V2_EAGLE3 = "v1/worker/gpu_model_runner.py", "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"


def _at(spec: int | None, runner: int | None, v2: int | None = None) -> str:
    files = [f"config/speculative.py:{spec}"] if spec else []
    return " + ".join(files + [f"{RUNNER}:{runner}"] * bool(runner) + [f"{V2_EAGLE3}:{v2}"] * bool(v2))


VLLM_EAGLE3 = {  # release read -> the verifiers it serves an EAGLE-3 draft for
    "0.11.0": VllmEagle3(LISTED_011, LACK_017 | {"Qwen3MoeForCausalLM"}, _at(540, 2644)),
    "0.12.0": VllmEagle3(LISTED_011, LACK_017, _at(620, 3529)),
    "0.13.0": VllmEagle3(LISTED_011, LACK_017, _at(621, 3628)),
    "0.14.0": VllmEagle3(LISTED_011, LACK_017, _at(633, 3874)),
    "0.15.0": VllmEagle3(LISTED_011, LACK_017, _at(666, 4087)),
    "0.16.0": VllmEagle3(LISTED_016, LACK_017, _at(689, 4190)),
    "0.17.0": VllmEagle3(None, LACK_017, _at(None, 4307, 18)),
    "0.18.0": VllmEagle3(None, LACK_018, _at(None, 4533, 18)),
    "0.19.0": VllmEagle3(None, LACK_018, _at(None, 4787, 18)),
    "0.20.0": VllmEagle3(None, LACK_020, _at(None, 4829, 18)),
    "0.21.0": VllmEagle3(None, LACK_020, _at(None, 4909, 18)),
    "0.22.0": VllmEagle3(None, LACK_020, _at(None, 5208, 18)),
    "0.23.0": VllmEagle3(None, LACK_020, _at(None, 5268, 18)),
    "0.24.0": VllmEagle3(None, LACK_024, _at(None, 5336, 18)),
    "0.25.0": VllmEagle3(None, LACK_024, _at(None, 5387, 18)),
    "0.26.0": VllmEagle3(None, LACK_024, _at(None, 5428, 18)),
    "0.27.0": VllmEagle3(None, LACK_024, _at(None, 5486, 18)),
    "0.28.0": VllmEagle3(None, LACK_024, _at(None, 5591, 18)),
    "0.29.0": VllmEagle3(None, LACK_024, _at(None, 5547, 18)),
    "0.30.0": VllmEagle3(None, LACK_024, _at(None, 5501, 19)),
    "0.31.0": VllmEagle3(None, LACK_024, _at(None, 5439, 19)),
    "0.32.0": VllmEagle3(None, LACK_024, _at(None, 5234, 19)),
    "0.33.0": VllmEagle3(None, LACK_024, _at(None, 5173, 28)),
    "0.34.0": VllmEagle3(None, LACK_024, _at(None, None, 18)),
}
