"""Training data in the layouts users already have: longrun's own, speculators' and SpecForge's offline data.

All three hold, per sample, the token ids, a loss mask, three captured verifier features and the verifier's
last hidden state; they differ in files, names and capture conventions. `open_training_data` finds the layout
(or takes `--data-format`), lists the sample files, and says which verifier layers the features are the inputs
of (what the exported draft's config.json must tell the engines). `TrainingData.dataset` reads the samples
into the batches `trainer.data` makes: `input_ids` int64, `loss_mask` uint8, `hidden_states` [S, 3H],
`last_hidden_state` [S, H], `attention_mask`.

- longrun (`trainer.prepare`): `sample_*.safetensors` in D or D/hidden_states; layers from prepare.json.
- speculators, offline data generation through vLLM (speculators v0.3.0 - v0.4.0.1,
  scripts/data_generation_offline.py): `data_{i}.pt` per sample, `torch.save` of {"input_ids" [S],
  "hidden_states": list of 4 [S, H] tensors, "loss_mask" [S]}. Its worker (data_generation/custom_worker.py)
  appends `hidden_states + residual` AFTER layer i runs: outputs of layers [2, N//2, N-3, N-1] by default, the
  last one before the final norm. Output of layer i = input of layer i + 1. The layer ids are in
  data_config.json (`hidden_states.layer_ids`) next to the samples.
- SpecForge, scripts/prepare_hidden_states.py @ a6b6b0230009 (sgl-project/SpecForge): `rows_{a}-{b}/data_{i}.ckpt`
  (`.ckpt.gz` when compressed), `torch.save` of {"input_ids" [S], "loss_mask" [S], "aux_hidden_state"
  [1, S, 3H], "hidden_state" [1, S, H]}. SGLang captures the inputs of layers [2, N//2, N-3] (its
  `set_eagle3_layers_to_capture` adds 1 to SpecForge's default [1, N//2-1, N-4]); `hidden_state` is the
  input of its lm_head, i.e. already through the final norm (SpecForge's TargetHead applies only the lm_head).
"""

import gzip
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainer.data import SAMPLE_PATTERN, TENSOR_NAMES, HiddenStatesDataset, list_samples
from trainer.verifier_model import default_layer_ids

DATA_FORMATS = ("longrun", "speculators", "specforge")


def _walk(data_dir: Path, match: Callable[[str], bool]) -> list[Path]:
    """Files under data_dir (recursively, as speculators and SpecForge lay them out) whose name matches, sorted."""
    found = []
    for root, _dirs, names in os.walk(data_dir):
        found.extend(Path(root) / name for name in names if match(name))
    return sorted(found)


def _speculators_files(data_dir: Path) -> list[Path]:
    return _walk(data_dir, lambda name: name.startswith("data_") and name.endswith(".pt"))


def _specforge_files(data_dir: Path) -> list[Path]:
    return _walk(data_dir, lambda name: name.startswith("data_") and name.endswith((".ckpt", ".ckpt.gz")))


def detect_format(data_dir: str | Path) -> str:
    """The layout of `data_dir`, from the names of the files in it."""
    data_dir = Path(data_dir)
    if list_samples(data_dir):
        return "longrun"
    if _speculators_files(data_dir):
        return "speculators"
    if _specforge_files(data_dir):
        return "specforge"
    raise FileNotFoundError(
        f"no training samples in {data_dir}: looked for longrun's {SAMPLE_PATTERN} (run `python -m trainer.prepare`), "
        "speculators' data_*.pt and SpecForge's data_*.ckpt[.gz]"
    )


def _torch_file(path: Path) -> dict:
    """A sample saved with torch.save (gzip-compressed for SpecForge's .ckpt.gz); tensors only, nothing executed."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return torch.load(f, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ValueError(f"{path}: not a readable torch-saved sample ({error})") from None


def _field(record: dict, key: str, path: Path, layout: str):
    if not isinstance(record, dict) or key not in record:
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise KeyError(f"{path} has no {key!r}: not a {layout} sample (it holds {found})")
    return record[key]


def read_speculators_sample(path: Path, rows: int) -> dict[str, torch.Tensor]:
    """The first `rows` positions of a speculators sample (only those are read from the memory-mapped file)."""
    record = _torch_file(path)
    layers = _field(record, "hidden_states", path, "speculators")
    if not isinstance(layers, list | tuple) or len(layers) != 4:
        raise ValueError(
            f"{path}: 'hidden_states' must be a list of 4 tensors (3 captured layers and the last layer), "
            f"found {len(layers) if isinstance(layers, list | tuple) else type(layers).__name__}"
        )
    return {
        "input_ids": _field(record, "input_ids", path, "speculators")[:rows].long(),
        "loss_mask": _field(record, "loss_mask", path, "speculators")[:rows].to(torch.uint8),
        "hidden_states": torch.cat([layer[:rows] for layer in layers[:3]], dim=-1),
        "last_hidden_state": layers[3][:rows],
    }


def read_specforge_sample(path: Path, rows: int) -> dict[str, torch.Tensor]:
    """The first `rows` positions of a SpecForge sample."""
    record = _torch_file(path)
    return {
        "input_ids": _field(record, "input_ids", path, "SpecForge").reshape(-1)[:rows].long(),
        "loss_mask": _field(record, "loss_mask", path, "SpecForge").reshape(-1)[:rows].to(torch.uint8),
        "hidden_states": _field(record, "aux_hidden_state", path, "SpecForge").squeeze(0)[:rows],
        "last_hidden_state": _field(record, "hidden_state", path, "SpecForge").squeeze(0)[:rows],
    }


class TorchSampleDataset(HiddenStatesDataset):
    """Per-sample torch files (speculators', SpecForge's), batched and packed exactly as `HiddenStatesDataset`
    batches its own files: only the reading of samples differs."""

    def __init__(self, files: Sequence[Path], max_seq_len: int, read: Callable[[Path, int], dict[str, torch.Tensor]]):
        super().__init__(None, max_seq_len, files=files)
        self.read = read

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """The four tensors of sample `index`, cut to max_seq_len; an error names a file whose rows disagree."""
        sample = self.read(self.files[index], self.max_seq_len)
        length = sample["input_ids"].shape[0]
        for name in TENSOR_NAMES:
            if sample[name].shape[0] != length:
                raise ValueError(f"{self.files[index]}: {name} has {sample[name].shape[0]} rows for {length} tokens")
        return sample

    def lengths(self) -> list[int]:
        return [self.sample(i)["input_ids"].shape[0] for i in range(len(self))]

    def _read_rows(self, rows: Sequence[Sequence[int]], pin: bool) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        samples = [[self.sample(i) for i in row] for row in rows]
        lengths = [[s["input_ids"].shape[0] for s in row] for row in samples]
        longest = max(sum(row) for row in lengths)
        out: dict[str, torch.Tensor] = {}
        for name in TENSOR_NAMES:
            first = samples[0][0][name]
            out[name] = torch.zeros((len(rows), longest, *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
            for row, (row_samples, row_lengths) in enumerate(zip(samples, lengths, strict=True)):
                out[name][row, : sum(row_lengths)] = torch.cat([s[name] for s in row_samples])
        out["attention_mask"] = torch.zeros((len(rows), longest), dtype=torch.long, pin_memory=pin)
        for row, row_lengths in enumerate(lengths):
            out["attention_mask"][row, : sum(row_lengths)] = 1
        return out, lengths


def _metadata(data_dir: Path, name: str) -> dict | None:
    for candidate in (data_dir / name, data_dir.parent / name):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    return None


@dataclass
class TrainingData:
    format: str
    files: list[Path]
    layer_ids: list[int]  # the verifier layers whose INPUTS the features are (longrun's convention)
    last_hidden_state_normed: bool  # the stored last hidden state is already through the final norm

    def dataset(self, files: Sequence[Path], max_seq_len: int) -> Dataset:
        """A dataset over `files` (a split of `self.files`) with `read_batch(indices, pin)`."""
        if self.format == "longrun":
            return HiddenStatesDataset(None, max_seq_len, files=files)
        read = read_speculators_sample if self.format == "speculators" else read_specforge_sample
        return TorchSampleDataset(files, max_seq_len, read)


def open_training_data(data_dir: str | Path, data_format: str, num_layers: int) -> TrainingData:
    """The samples of `data_dir` in `data_format` ("auto" detects it) for a verifier of `num_layers` layers."""
    data_dir = Path(data_dir)
    data = _open(data_dir, detect_format(data_dir) if data_format == "auto" else data_format, num_layers)
    if not data.files:
        raise FileNotFoundError(f"no {data.format} samples in {data_dir} (it holds {detect_format(data_dir)} data)")
    return data


def _open(data_dir: Path, data_format: str, num_layers: int) -> TrainingData:
    if data_format == "longrun":
        metadata = _metadata(data_dir, "prepare.json") or {}
        return TrainingData("longrun", list_samples(data_dir), metadata.get("layer_ids", default_layer_ids(num_layers)),
                            last_hidden_state_normed=False)
    if data_format == "speculators":
        config = _metadata(data_dir, "data_config.json") or {}
        captured = (config.get("hidden_states") or {}).get("layer_ids") or [2, num_layers // 2, num_layers - 3]
        layer_ids = [i + 1 for i in captured[:3]]  # speculators captures layer outputs
        return TrainingData("speculators", _speculators_files(data_dir), layer_ids, last_hidden_state_normed=False)
    if data_format == "specforge":
        return TrainingData("specforge", _specforge_files(data_dir), default_layer_ids(num_layers),
                            last_hidden_state_normed=True)
    raise ValueError(f"unknown data format {data_format!r}; expected auto or one of {', '.join(DATA_FORMATS)}")
