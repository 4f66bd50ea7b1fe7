"""Offline training data in speculators' and SpecForge's layouts, written the way their own code writes it.

Neither writer imports without its GPU engine (speculators' lives in scripts/data_generation_offline.py and
drives vLLM; SpecForge's in scripts/prepare_hidden_states.py and drives SGLang), so this follows their source:

- speculators v0.4.0.1 (github.com/vllm-project/speculators, tag v0.4.0.1):
  scripts/data_generation_offline.py `save_sample_to_disk`: torch.save({"input_ids": [S] long, "hidden_states":
  [h.contiguous() for h in layers], "loss_mask": [S] long}, output_dir / f"data_{idx}.pt"); the layers come
  from data_generation/custom_worker.py, which appends `hidden_states + residual` after layer i runs (the
  OUTPUT of layer i; default layer_ids [2, N//2, N-3, N-1], the last before the final norm);
  data_generation/config_generator.py writes data_config.json with `hidden_states.layer_ids`;
  train/vocab_mapping.py `build_vocab_mappings_from_distribution` + scripts/build_vocab_mapping.py np.save the
  maps as d2t.npy / t2d.npy; `save_token_frequency_distribution` torch.saves {token_id: count}.
- SpecForge @ a6b6b0230009d15ec2a97a57384e6f53f0f96946 (github.com/sgl-project/SpecForge):
  scripts/prepare_hidden_states.py `_get_file_path` (rows_{g}-{g + 2000}/data_{idx}.ckpt, `.ckpt.gz` with
  --compress), `_save_tensor_sync` (torch.save, through gzip.open when compressed) of the record built by
  OfflineCaptureLayout("eagle3", aux_feature="aux_hidden_state", last_hidden_feature="hidden_state",
  passthrough input_ids, loss_mask): aux_hidden_state [1, S, 3H] = SGLang's captured layer inputs,
  hidden_state [1, S, H] = the input of the lm_head (after the final norm); vocab_mapping/vocab_mapping.pt
  holds {"d2t", "t2d"}.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # for the annotations only: transformers' Llama costs a collecting pytest process seconds of CPU
    from transformers import LlamaForCausalLM

SPECFORGE_FILE_GROUP = 2000


@torch.no_grad()
def layer_states(verifier: LlamaForCausalLM, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(transformers' hidden states: [i] is the input of layer i; the last layer's output before the final norm)."""
    last = {}
    handle = verifier.model.layers[-1].register_forward_hook(
        lambda module, args, output: last.setdefault("out", output[0] if isinstance(output, tuple) else output)
    )
    try:
        states = verifier(input_ids=ids[None], output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return states, last["out"]


def speculators_vocab_mapping(token_freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int):
    """train/vocab_mapping.py `build_vocab_mappings_from_distribution` (v0.4.0.1): d2t offsets, t2d bool."""
    selected = sorted(token_freq, key=lambda tid: (-token_freq[tid], tid))[:draft_vocab_size]
    chosen = set(selected)
    for tid in range(draft_vocab_size):
        if len(selected) >= draft_vocab_size:
            break
        if tid not in chosen:
            selected.append(tid)
    selected.sort()
    d2t = torch.tensor(selected, dtype=torch.long) - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def write_speculators(verifier: LlamaForCausalLM, samples: list[tuple[torch.Tensor, torch.Tensor]], out: Path,
                      layer_ids: list[int] | None, draft_vocab_size: int) -> dict[str, Path]:
    """out/data/data_{i}.pt (+ data_config.json when `layer_ids` is given), out/token_freq.pt, out/vocab/d2t.npy, t2d.npy."""
    num_layers = verifier.config.num_hidden_layers
    captured = layer_ids or [2, num_layers // 2, num_layers - 3, num_layers - 1]
    (out / "data").mkdir(parents=True)
    freq: dict[int, int] = {}
    for idx, (ids, loss_mask) in enumerate(samples):
        states, last = layer_states(verifier, ids)
        # output of layer i = transformers' hidden_states[i + 1]; the last layer's is taken before the norm
        layers = [states[i + 1][0] if i < num_layers - 1 else last[0] for i in captured]
        record = {"input_ids": ids, "hidden_states": [h.to(torch.bfloat16).contiguous() for h in layers],
                  "loss_mask": loss_mask.long()}
        torch.save(record, out / "data" / f"data_{idx}.pt")
        for tid in ids[loss_mask.bool()].tolist():
            freq[tid] = freq.get(tid, 0) + 1
    if layer_ids is not None:
        (out / "data" / "data_config.json").write_text(json.dumps(
            {"version": "2.0", "hidden_states": {"layer_ids": layer_ids}, "format": {"file_pattern": "data_{idx}.pt"}}))
    torch.save(freq, out / "token_freq.pt")
    d2t, t2d = speculators_vocab_mapping(freq, draft_vocab_size, verifier.config.vocab_size)
    (out / "vocab").mkdir()
    np.save(out / "vocab" / "d2t.npy", d2t.cpu().numpy())
    np.save(out / "vocab" / "t2d.npy", t2d.cpu().numpy())
    return {"data": out / "data", "vocab": out / "vocab"}


def write_specforge(verifier: LlamaForCausalLM, samples: list[tuple[torch.Tensor, torch.Tensor]], out: Path,
                    compress: bool, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, Path]:
    """out/rows_0-2000/data_{i}.ckpt[.gz] and out/vocab_mapping/vocab_mapping.pt, SGLang's default capture layers."""
    num_layers = verifier.config.num_hidden_layers
    inputs_of = [2, num_layers // 2, num_layers - 3]  # set_eagle3_layers_to_capture([1, N//2 - 1, N - 4])
    for idx, (ids, loss_mask) in enumerate(samples):
        states, last = layer_states(verifier, ids)
        with torch.no_grad():
            normed = verifier.model.norm(last)
        record = {
            "input_ids": ids.clone(),
            "loss_mask": loss_mask.clone(),
            "aux_hidden_state": torch.cat([states[i] for i in inputs_of], dim=-1).to(torch.bfloat16),
            "hidden_state": normed.to(torch.bfloat16),
        }
        group = idx // SPECFORGE_FILE_GROUP * SPECFORGE_FILE_GROUP
        path = out / f"rows_{group}-{group + SPECFORGE_FILE_GROUP}" / f"data_{idx}.ckpt{'.gz' if compress else ''}"
        path.parent.mkdir(parents=True, exist_ok=True)
        if compress:
            with gzip.open(path, "wb", compresslevel=6) as f:
                torch.save(record, f)
        else:
            torch.save(record, path)
    (out / "vocab_mapping").mkdir()
    torch.save({"d2t": d2t, "t2d": t2d}, out / "vocab_mapping" / "vocab_mapping.pt")
    return {"data": out, "vocab": out / "vocab_mapping"}


def write_speculators_arrow(verifier_path: Path, verifier: LlamaForCausalLM,
                            samples: list[tuple[torch.Tensor, torch.Tensor]], out: Path, draft_vocab_size: int,
                            fp8: bool = False, layer_ids: list[int] | None = None) -> Path:
    """A speculators >= 0.5 dataset in `out`, written with speculators 0.9.0's own code where it runs on the CPU.

    - the Arrow rows: `build_speculator_training_dataset` (data_generation/preprocessing.py; speculator-format
      rows pass straight through) and `save_to_disk`, as cli/prepare_data.py does; `save_token_frequency_distribution`
      (train/vocab_mapping.py) writes token_freq.pt;
    - the vocab maps: train/cli.py `_generate_vocab_mappings` writes d2t-<size>.npy and t2d-<size>.npy;
    - hidden_states/hs_{i}.safetensors: what vLLM's ExampleHiddenStatesConnector (extract_hidden_states, driven by
      scripts/launch_vllm.py) saves, {"hidden_states": [S, 4, H] bf16, "token_ids": [S] int64}, the inputs of
      layers [2, N//2, N-3] (or `layer_ids`) and of "layer N", the last layer's output before the final norm;
      with `fp8`, hs_connectors 0.9.0's `FP8HiddenStatesConnector._write_tensors`: `quantize_tensor_to_fp8` and
      the scales under `SCALES_KEY`. vLLM itself does not run here (it needs a GPU); the tensors are the same.
    """
    from argparse import Namespace

    from datasets import Dataset as HFDataset
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
    from safetensors.torch import save_file
    from speculators.data_generation.preprocessing import build_speculator_training_dataset
    from speculators.train.cli import _generate_vocab_mappings
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    num_layers = verifier.config.num_hidden_layers
    captured = [*(layer_ids or [2, num_layers // 2, num_layers - 3]), num_layers]
    raw = HFDataset.from_dict({"input_ids": [ids.tolist() for ids, _ in samples],
                               "loss_mask": [mask.long().tolist() for _, mask in samples]})
    environ = os.environ
    try:
        dataset = build_speculator_training_dataset(raw, None, max_length=4096, num_proc=1)
    finally:
        os.environ = environ  # noqa: B003 (datasets leaves a copy bound)
    dataset.save_to_disk(str(out))
    save_token_frequency_distribution(dataset, out / "token_freq.pt")
    _generate_vocab_mappings(Namespace(token_freq_path=None, verifier_name_or_path=str(verifier_path),
                                       trust_remote_code=False, draft_vocab_size=draft_vocab_size), out)
    (out / "hidden_states").mkdir()
    for idx in range(len(dataset)):
        ids = dataset[idx]["input_ids"].long()
        states, last = layer_states(verifier, ids)
        layers = [states[i][0] if i < num_layers else last[0] for i in captured]
        tensors = {"hidden_states": torch.stack(layers, dim=1).to(torch.bfloat16).contiguous(), "token_ids": ids}
        if fp8:
            quantized, scales = quantize_tensor_to_fp8(tensors["hidden_states"])
            tensors = {**tensors, "hidden_states": quantized, SCALES_KEY: scales}
        save_file(tensors, str(out / "hidden_states" / f"hs_{idx}.safetensors"))
    return out
