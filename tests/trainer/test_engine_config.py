"""The exported draft's config.json makes vLLM and SGLang capture exactly the verifier features it was trained on.

Each engine's config reading is emulated from its source, on the config as transformers loads it (both engines
load the draft's config.json into a transformers config object):

- vLLM, vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ da84445036cc0892da52c329f330064cba1a46ab
  (`get_eagle3_aux_layers_from_config`: the top-level `eagle_aux_hidden_state_layer_ids`, else the model's
  `get_eagle3_aux_hidden_state_layers()` = (2, N // 2, N - 3)), and vllm/v1/worker/gpu_model_runner.py
  @ 4e1790651fc758c06c7a903dd4cd82364ac91b27 (the same key first, then `eagle_config`'s, taken as is).
  Capture, vllm/model_executor/models/llama.py `LlamaModel.forward`: `if idx in self.aux_hidden_state_layers:
  aux_hidden_states.append(hidden_states + residual)` before layer idx runs, i.e. the input of layer idx.
- SGLang, python/sglang/srt/model_executor/model_runner.py @ 01cc04e2b5b01ce379698a3fee1bd17706e1d0ec:
  `eagle_config["eagle_aux_hidden_state_layer_ids"]` (None when absent) passed to the model's
  `set_eagle3_layers_to_capture`: None -> layers_to_capture = [2, N // 2, N - 3], else [val + 1 for val in
  layer_ids]. Capture, python/sglang/srt/models/llama.py `LlamaModel.forward`: `if i in self.layers_to_capture:
  aux_hidden_states.append(hidden_states + residual)` before layer i runs, i.e. the input of layer i.

In transformers, `output_hidden_states[i]` is the input of decoder layer i, which is what both engines capture.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.conftest import one_cpu_thread
from trainer.formats import open_training_data
from trainer.model import DraftConfig, EagleDraft, read_draft_config, save_draft
from trainer.verifier_model import read_verifier_config

# transformers (and trainer.prepare, which imports it) where used, not at collection: seconds of CPU in each pytest
# process that collects this module


def vllm_capture_layers(draft_dir: Path, verifier_layers: int) -> list[int]:
    from transformers import LlamaConfig

    hf_config = LlamaConfig.from_pretrained(draft_dir)
    layer_ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    if not (layer_ids and isinstance(layer_ids, list | tuple)):
        eagle_config = getattr(hf_config, "eagle_config", None)
        layer_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    if layer_ids and isinstance(layer_ids, list | tuple):
        return list(layer_ids)
    return [2, verifier_layers // 2, verifier_layers - 3]


def sglang_capture_layers(draft_dir: Path, verifier_layers: int) -> list[int]:
    from transformers import LlamaConfig

    hf_config = LlamaConfig.from_pretrained(draft_dir)
    try:
        layer_ids = hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    except (AttributeError, KeyError, TypeError):
        layer_ids = None
    if layer_ids is None:
        return [2, verifier_layers // 2, verifier_layers - 3]
    return [val + 1 for val in layer_ids]


def export_draft_trained_on(data_dir: Path, verifier: Path, out: Path) -> Path:
    """A draft shaped and configured the way `trainer.train` builds it for this data, saved for the engines."""
    config = DraftConfig.from_verifier(read_verifier_config(verifier), draft_vocab_size=32, ttt_steps=1)
    config.aux_hidden_state_layer_ids = open_training_data(data_dir, "auto", read_verifier_config(verifier)["num_hidden_layers"]).layer_ids
    save_draft(EagleDraft(config), out)
    return out


@pytest.mark.parametrize("layer_ids", [None, [1, 3, 6]], ids=["default", "custom"])
def test_each_engine_captures_the_features_the_draft_was_trained_on(tiny_verifier, tiny_corpus, tmp_path, layer_ids):
    from transformers import AutoModelForCausalLM

    from trainer.prepare import prepare

    with one_cpu_thread():
        metadata = prepare(tiny_verifier, tiny_corpus, tmp_path / "data", max_seq_len=32, draft_vocab_size=32,
                           max_samples=2, layer_ids=layer_ids, device="cpu")
    draft_dir = export_draft_trained_on(tmp_path / "data", tiny_verifier, tmp_path / "draft")
    layers = metadata["num_hidden_layers"]
    assert read_draft_config(draft_dir).aux_hidden_state_layer_ids == metadata["layer_ids"]

    sample = load_file(str(tmp_path / "data" / "hidden_states" / "sample_000000.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier, dtype=torch.float32).eval()
    with torch.no_grad():
        layer_inputs = model(sample["input_ids"][None], output_hidden_states=True).hidden_states
    for engine, capture in (("vLLM", vllm_capture_layers), ("SGLang", sglang_capture_layers)):
        captured = capture(draft_dir, layers)
        assert captured == metadata["layer_ids"], engine
        features = torch.cat([layer_inputs[i][0] for i in captured], dim=-1)
        torch.testing.assert_close(features.to(torch.bfloat16), sample["hidden_states"], atol=0.05, rtol=0.02,
                                   msg=f"{engine} would feed the draft other features than it was trained on")


def test_a_draft_from_another_trainer_reads_its_layers_from_the_engine_keys(tmp_path):
    config = DraftConfig.from_verifier(
        {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 8, "intermediate_size": 128,
         "vocab_size": 512}, draft_vocab_size=32, ttt_steps=1)
    config.aux_hidden_state_layer_ids = [1, 3, 6]
    engine = config.to_engine_config()
    del engine["aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(engine))
    assert read_draft_config(tmp_path).aux_hidden_state_layer_ids == [1, 3, 6]
    del engine["eagle_aux_hidden_state_layer_ids"]  # a SpecForge export: only eagle_config, outputs of layers
    (tmp_path / "config.json").write_text(json.dumps(engine))
    assert read_draft_config(tmp_path).aux_hidden_state_layer_ids == [1, 3, 6]
