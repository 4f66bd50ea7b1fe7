"""Training data in the layouts users already have: longrun's own, speculators' and SpecForge's offline data.

All three hold, per sample, the token ids, a loss mask, three captured verifier features and the verifier's
last hidden state; they differ in files, names and capture conventions. `open_training_data` finds the layout
(or takes `--data-format`), lists the sample files, and says which verifier layers the features are the inputs
of (what the exported draft's config.json must tell the engines). `TrainingData.dataset` reads the samples
into the batches `trainer.data` makes: `input_ids` int64, `loss_mask` uint8, `hidden_states` [S, 3H],
`last_hidden_state` [S, H], `attention_mask`.

- longrun (`trainer.prepare`): `sample_*.safetensors` in D or D/hidden_states; layers from prepare.json.
  Features in bf16, or FP8 with per-token scales (`prepare --store-dtype fp8`).
- speculators >= 0.5 (speculators 0.9.0: cli/prepare_data.py, cli/generate_offline_data.py, train/data.py
  `ArrowDataset`): D is a Hugging Face `save_to_disk` Arrow dataset (state.json, data-*.arrow with `input_ids`,
  `loss_mask`, `seq_len`) and D/hidden_states/hs_{i}.safetensors holds row i's `token_ids` [S] and
  `hidden_states` [S, 4, H], written by vLLM's hidden-state connector: the INPUTS of the layers given to vLLM as
  `eagle_aux_hidden_state_layer_ids` (scripts/launch_vllm.py: [2, N//2, N-3] and N, the last layer's output
  before the final norm), so no +1. hs_connectors' FP8 connector (hs_connectors 0.9.0, fp8_utils.py) stores
  `hidden_states` as float8_e4m3fn with `hidden_states_scales` float32 [S, 1, 1]. No file records the layer
  ids: `--layer-ids`, or `eagle_aux_hidden_state_layer_ids` in the hs files' safetensors metadata; either may
  give the 4 ids speculators users hold (`2 30 58 61`), whose last is the verifier's last layer N
  (launch_vllm.py appends num_hidden_layers; speculators' train/config/schema.py `target_layer_ids`: "excluding
  the final layer launch_vllm.py appends"): that is the target slot, the first three the captured layers.
  Row i's file must exist for every row: speculators' ArrowDataset (train/data.py `_get_raw_data`,
  on_missing="raise") refuses a missing one ("Failed to load hidden states for sample i"), and so does this.
  Vocab maps: d2t-<size>.npy / t2d-<size>.npy in D (trainer.vocab reads them).
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
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainer.data import (
    FP8_DTYPE,
    FP8_SCALES,
    SAMPLE_PATTERN,
    TENSOR_NAMES,
    HiddenStatesDataset,
    SampleFile,
    list_samples,
)
from trainer.verifier_model import default_layer_ids

DATA_FORMATS = ("longrun", "speculators", "specforge")
# what detection looks for, in order (both speculators layouts answer to --data-format speculators)
TRIED = (f"longrun ({SAMPLE_PATTERN})", "speculators >= 0.5 (Arrow dataset + hidden_states/hs_*.safetensors)",
         "speculators 0.3-0.4 (data_*.pt)", "SpecForge (data_*.ckpt[.gz])")
HS_FILE_KEYS = ("hidden_states", "token_ids")
HS_SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY
LAYER_IDS_METADATA_KEY = "eagle_aux_hidden_state_layer_ids"


def _walk(data_dir: Path, match: Callable[[str], bool]) -> list[Path]:
    """Files under data_dir (recursively, as speculators and SpecForge lay them out) whose name matches, sorted."""
    found = []
    for root, _dirs, names in os.walk(data_dir):
        found.extend(Path(root) / name for name in names if match(name))
    return sorted(found)


def _speculators_files(data_dir: Path) -> list[Path]:
    return _walk(data_dir, lambda name: name.startswith("data_") and name.endswith(".pt"))


def _arrow_layout(data_dir: Path) -> tuple[Path, Path] | None:
    """(the Arrow dataset's directory, its hidden_states directory) when `data_dir` is either of them."""
    for dataset_dir, hs_dir in ((data_dir, data_dir / "hidden_states"), (data_dir.parent, data_dir)):
        if (dataset_dir / "state.json").is_file() and hs_dir.is_dir():
            return dataset_dir, hs_dir
    return None


def _hs_index(path: Path) -> int | None:
    stem = path.name.removeprefix("hs_").removesuffix(".safetensors")
    return int(stem) if path.name.startswith("hs_") and path.name.endswith(".safetensors") and stem.isdigit() else None


def _hs_files(hs_dir: Path) -> list[Path]:
    """hs_{i}.safetensors in row order (hs_10 after hs_9)."""
    return sorted((p for p in hs_dir.iterdir() if _hs_index(p) is not None), key=_hs_index)


def compact_ranges(numbers: Sequence[int], limit: int = 20) -> str:
    """`1, 7-9, 12`: sorted numbers with runs joined; past `limit` runs, how many more."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit])
    rest = sum(b - a + 1 for a, b in runs[limit:])
    return shown + (f" and {rest} more" if rest else "")


def _check_hs_numbering(files: list[Path], hs_dir: Path, rows: int, dataset_dir: Path) -> None:
    """One hs_{i}.safetensors for each Arrow row i, no more: a missing file is refused, as speculators' reader
    refuses it, rather than trained around."""
    indices = Counter(_hs_index(path) for path in files)
    missing = [i for i in range(rows) if i not in indices]
    past = [i for i in indices if i >= rows]
    twice = [i for i, count in indices.items() if count > 1]
    if not (missing or past or twice):
        return
    problems = []
    if missing:
        problems.append(f"no hs_{{i}}.safetensors for row{'s' if len(missing) > 1 else ''} {compact_ranges(missing)} "
                        f"({len(missing)} of {rows}; speculators' own reader stops there too: \"Failed to load "
                        f"hidden states for sample {missing[0]}\")")
    if past:
        problems.append(f"files past the last row {rows - 1}: hs_ {compact_ranges(past)}")
    if twice:
        problems.append(f"more than one file for row {compact_ranges(twice)} (leading zeros?)")
    raise ValueError(f"{hs_dir}: {len(files)} hidden-states files for the {rows} rows of {dataset_dir}: "
                     f"{'; '.join(problems)}. Capture the missing rows again (speculators' launch_vllm.py + "
                     "data_generation_offline.py), or save the Arrow dataset without those rows and renumber")


def parse_layer_ids(text: str) -> list[int]:
    """`2,30,58`, `2 30 58 61` or `[2, 30, 58, 61]`: the whole numbers given, in order."""
    parts = [p for p in re.split(r"[\s,]+", text.strip().strip("[]()")) if p]
    if not parts or not all(p.isdigit() and len(p) <= 6 for p in parts):
        raise ValueError(f"layer ids {text!r}: expected whole numbers separated by commas or spaces, e.g. 2,30,58")
    return [int(p) for p in parts]


def capture_layer_ids(ids: Sequence[int], num_layers: int, source: str) -> tuple[list[int], str | None]:
    """(the 3 captured layers, a note saying what was done with a 4th id) from `ids` as given in `source`.

    4 ids are speculators' form: launch_vllm.py appends num_hidden_layers, the verifier's last layer (its output
    before the final norm), to the 3 captured; that slot is the target, not a feature."""
    ids = [int(i) for i in ids]
    shown = " ".join(map(str, ids))
    if len(ids) == 3:
        return ids, None
    if len(ids) == 4 and ids[3] == num_layers:
        return ids[:3], (f"layer ids {shown} ({source}): {num_layers} is the verifier's last layer, used as the "
                         f"target; capture layers {' '.join(map(str, ids[:3]))}")
    if len(ids) == 4:
        raise ValueError(f"layer ids {shown} ({source}): 4 ids are speculators' form, whose last is the verifier's "
                         f"last layer ({num_layers} for this {num_layers}-layer verifier; launch_vllm.py appends "
                         f"num_hidden_layers), not {ids[3]}. Give the 3 captured layers, or the 4 ending in "
                         f"{num_layers}")
    raise ValueError(f"layer ids {shown} ({source}): expected the 3 captured layers (e.g. "
                     f"{' '.join(map(str, default_layer_ids(num_layers)))}), or speculators' 4 ending in the "
                     f"verifier's last layer {num_layers}")


def _specforge_files(data_dir: Path) -> list[Path]:
    return _walk(data_dir, lambda name: name.startswith("data_") and name.endswith((".ckpt", ".ckpt.gz")))


def detect_format(data_dir: str | Path) -> str:
    """The layout of `data_dir`, from the names of the files in it."""
    data_dir = Path(data_dir)
    found = _found_format(data_dir)
    if found is None:
        raise FileNotFoundError(f"no training samples in {data_dir}; formats tried: {'; '.join(TRIED)} "
                                "(run `python -m trainer.prepare` to make longrun's)")
    return found


def _found_format(data_dir: Path) -> str | None:
    if list_samples(data_dir):
        return "longrun"
    layout = _arrow_layout(data_dir)
    if (layout and _hs_files(layout[1])) or _speculators_files(data_dir):
        return "speculators"
    if _specforge_files(data_dir):
        return "specforge"
    return None


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


class ArrowRows:
    """`input_ids`, `loss_mask` and `seq_len` of a `datasets.save_to_disk` directory, memory-mapped with pyarrow
    (its shards are Arrow IPC streams, listed in state.json `_data_files`), read without `datasets`."""

    def __init__(self, dataset_dir: Path):
        import pyarrow as pa

        state_path = dataset_dir / "state.json"
        try:
            shards = [dataset_dir / f["filename"] for f in json.loads(state_path.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{state_path}: no '_data_files' ({error!r}): not a speculators >= 0.5 Arrow dataset; "
                             f"formats tried: {'; '.join(TRIED)}") from None
        tables = []
        for shard in shards:
            try:
                tables.append(pa.ipc.open_stream(pa.memory_map(str(shard))).read_all())
            except (OSError, pa.ArrowInvalid) as error:
                raise ValueError(f"{shard}: not an Arrow stream ({error})") from None
            missing = {"input_ids", "loss_mask"} - set(tables[-1].column_names)
            if missing:
                raise KeyError(f"{shard} has no {sorted(missing)}: not a speculators >= 0.5 dataset "
                               f"(it holds {tables[-1].column_names}); formats tried: {'; '.join(TRIED)}")
        table = pa.concat_tables(tables)
        self.path = dataset_dir
        self.columns = {}
        for name in ("input_ids", "loss_mask"):
            column = table.column(name).combine_chunks()
            self.columns[name] = (column.offsets.to_numpy(), column.values.to_numpy(zero_copy_only=False))

    def __len__(self) -> int:
        return len(self.columns["input_ids"][0]) - 1

    def row(self, name: str, index: int) -> torch.Tensor:
        offsets, values = self.columns[name]
        return torch.from_numpy(values[offsets[index] : offsets[index + 1]].copy())

    def length(self, index: int) -> int:
        offsets = self.columns["input_ids"][0]
        return int(offsets[index + 1] - offsets[index])


def read_hs_file(path: Path, rows: int, arrow: ArrowRows) -> dict[str, torch.Tensor]:
    """The first `rows` positions of hs_{i}.safetensors and row i of the Arrow dataset; FP8 stays FP8, with its
    per-token scale, for `trainer.data.dequantize` on the device."""
    index = _hs_index(path)
    with open(path, "rb", buffering=0) as file:
        hs = SampleFile(file, path, HS_FILE_KEYS, f"a speculators >= 0.5 hidden-states file; formats tried: "
                        f"{'; '.join(TRIED)}")
        dtype, shape = hs.dtype_and_row_shape("hidden_states")
        if len(shape) != 2 or shape[0] != 4:
            raise ValueError(f"{path}: 'hidden_states' rows are {shape}, expected [4, H] (3 captured layers and "
                             "the last): not a speculators >= 0.5 EAGLE-3 file")
        n = min(hs.rows("token_ids"), rows)
        if hs.rows("hidden_states") != hs.rows("token_ids"):
            raise ValueError(f"{path}: 'hidden_states' has {hs.rows('hidden_states')} rows for "
                             f"{hs.rows('token_ids')} 'token_ids'")
        states = torch.empty((n, *shape), dtype=dtype)
        hs.read_rows("hidden_states", states)
        token_ids = torch.empty(n, dtype=hs.dtype_and_row_shape("token_ids")[0])
        hs.read_rows("token_ids", token_ids)
        scales = None
        if dtype == FP8_DTYPE:
            if HS_SCALES_KEY not in hs.entries:
                raise KeyError(f"{path} has float8 'hidden_states' and no {HS_SCALES_KEY!r}: the scales of "
                               "hs_connectors' FP8 connector are missing")
            scales = torch.empty((n, *hs.dtype_and_row_shape(HS_SCALES_KEY)[1]), dtype=torch.float32)
            hs.read_rows(HS_SCALES_KEY, scales)
    if index >= len(arrow):
        raise IndexError(f"{path}: row {index} is past the {len(arrow)} rows of {arrow.path}")
    input_ids = arrow.row("input_ids", index)[:n].long()
    if not torch.equal(input_ids, token_ids.long()):
        raise ValueError(f"{path}: 'token_ids' differ from 'input_ids' of row {index} of {arrow.path}: the hidden "
                         "states are of another sample")
    sample = {
        "input_ids": input_ids,
        "loss_mask": arrow.row("loss_mask", index)[:n].to(torch.uint8),
        "hidden_states": states[:, :3].reshape(n, 3 * shape[1]),
        "last_hidden_state": states[:, 3].contiguous(),
    }
    if scales is not None:  # one scale per token over all four layers
        for scale in FP8_SCALES.values():
            sample[scale] = scales.reshape(n, 1)
    return sample


class TorchSampleDataset(HiddenStatesDataset):
    """Per-sample torch files (speculators', SpecForge's), batched and packed exactly as `HiddenStatesDataset`
    batches its own files: only the reading of samples differs."""

    def __init__(self, files: Sequence[Path], max_seq_len: int, read: Callable[[Path, int], dict[str, torch.Tensor]],
                 hidden_size: int | None = None):
        super().__init__(None, max_seq_len, files=files, hidden_size=hidden_size)
        self.read = read

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        """The four tensors of sample `index`, cut to max_seq_len; an error names a file whose rows disagree, or
        whose features are of another hidden size, with its shapes."""
        sample = self.read(self.files[index], self.max_seq_len)
        length = sample["input_ids"].shape[0]
        for name in TENSOR_NAMES:
            if sample[name].shape[0] != length:
                raise ValueError(f"{self.files[index]}: {name} has {sample[name].shape[0]} rows for {length} tokens")
        hidden, last = sample["hidden_states"], sample["last_hidden_state"]
        self.widths.check(self.files[index], hidden.shape[-1] if hidden.dim() > 1 else 0,
                          last.shape[-1] if last.dim() > 1 else 0, self.stored(sample))
        return sample

    def stored(self, sample: dict[str, torch.Tensor]) -> str:
        """What the file holds, as its tool names it, for an error."""
        return (f"hidden_states {list(sample['hidden_states'].shape)}, last_hidden_state "
                f"{list(sample['last_hidden_state'].shape)}")

    def lengths(self) -> list[int]:
        return [self.sample(i)["input_ids"].shape[0] for i in range(len(self))]

    def _read_rows(self, rows: Sequence[Sequence[int]], pin: bool) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        samples = [[self.sample(i) for i in row] for row in rows]
        lengths = [[s["input_ids"].shape[0] for s in row] for row in samples]
        longest = max(sum(row) for row in lengths)
        out: dict[str, torch.Tensor] = {}
        every = [s for row in samples for s in row]
        scales = [name for name in FP8_SCALES.values() if any(name in s for s in every)]
        if scales and not all(name in s for s in every for name in scales):
            raise ValueError(f"{self.files[rows[0][0]].parent}: FP8 and bf16 samples in one batch; one dataset, "
                             "one storage")
        for name in (*TENSOR_NAMES, *scales):
            first = samples[0][0][name]
            out[name] = torch.zeros((len(rows), longest, *first.shape[1:]), dtype=first.dtype, pin_memory=pin)
            for row, (row_samples, row_lengths) in enumerate(zip(samples, lengths, strict=True)):
                out[name][row, : sum(row_lengths)] = torch.cat([s[name] for s in row_samples])
        out["attention_mask"] = torch.zeros((len(rows), longest), dtype=torch.long, pin_memory=pin)
        for row, row_lengths in enumerate(lengths):
            out["attention_mask"][row, : sum(row_lengths)] = 1
        return out, lengths


class ArrowDatasetSamples(TorchSampleDataset):
    """speculators >= 0.5 data: the files are hs_{i}.safetensors; lengths come from the Arrow rows."""

    def __init__(self, files: Sequence[Path], max_seq_len: int, arrow: ArrowRows, hidden_size: int | None = None):
        super().__init__(files, max_seq_len, lambda path, rows: read_hs_file(path, rows, arrow), hidden_size)
        self.arrow = arrow

    def stored(self, sample: dict[str, torch.Tensor]) -> str:
        rows, width = sample["last_hidden_state"].shape if sample["last_hidden_state"].dim() == 2 else (0, 0)
        return f"'hidden_states' [{rows}, 4, {width}] (its first {rows} rows)"

    def lengths(self) -> list[int]:
        return [min(self.arrow.length(_hs_index(path)), self.max_seq_len) for path in self.files]


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
    arrow: ArrowRows | None = field(default=None, repr=False)  # speculators >= 0.5: the token rows
    hidden_size: int | None = None  # the verifier's: every sample's features are checked against it
    notes: list[str] = field(default_factory=list)  # what was made of the inputs, for the training log

    def dataset(self, files: Sequence[Path], max_seq_len: int) -> Dataset:
        """A dataset over `files` (a split of `self.files`) with `read_batch(indices, pin)`."""
        if self.format == "longrun":
            return HiddenStatesDataset(None, max_seq_len, files=files, hidden_size=self.hidden_size)
        if self.arrow is not None:
            return ArrowDatasetSamples(files, max_seq_len, self.arrow, self.hidden_size)
        read = read_speculators_sample if self.format == "speculators" else read_specforge_sample
        return TorchSampleDataset(files, max_seq_len, read, self.hidden_size)


def open_training_data(data_dir: str | Path, data_format: str, num_layers: int,
                       layer_ids: Sequence[int] | None = None, hidden_size: int | None = None) -> TrainingData:
    """The samples of `data_dir` in `data_format` ("auto" detects it) for a verifier of `num_layers` layers (and
    `hidden_size`, which every sample's features must match); `layer_ids` (`--layer-ids`: the layers whose inputs
    the features are, or speculators' 4 ending in the last layer) overrides what the data says."""
    data_dir = Path(data_dir)
    notes = []
    if layer_ids:
        layer_ids, note = capture_layer_ids(layer_ids, num_layers, "--layer-ids")
        notes += [note] if note else []
    data = _open(data_dir, detect_format(data_dir) if data_format == "auto" else data_format, num_layers,
                 list(layer_ids) if layer_ids else None)
    data.hidden_size, data.notes = hidden_size, notes + data.notes
    if not data.files:
        found = _found_format(data_dir)
        holds = f"it holds {found} data" if found else f"formats tried: {'; '.join(TRIED)}"
        raise FileNotFoundError(f"no {data.format} samples in {data_dir} ({holds})")
    if len(data.layer_ids) != 3 or not all(0 <= i <= num_layers for i in data.layer_ids):
        raise ValueError(f"layer ids {data.layer_ids} for {data_dir}: expected 3 ids in [0, {num_layers}]")
    return data


def _open(data_dir: Path, data_format: str, num_layers: int, layer_ids: list[int] | None) -> TrainingData:
    if data_format == "longrun":
        metadata = _metadata(data_dir, "prepare.json") or {}
        recorded = metadata.get("layer_ids")
        if layer_ids and recorded and list(recorded) != layer_ids:
            raise ValueError(f"--layer-ids {layer_ids}, but {data_dir} was prepared from layers {recorded} "
                             "(prepare.json 'layer_ids')")
        return TrainingData("longrun", list_samples(data_dir), layer_ids or recorded or default_layer_ids(num_layers),
                            last_hidden_state_normed=False)
    if data_format == "speculators":
        layout = _arrow_layout(data_dir)
        if layout and _hs_files(layout[1]):
            return _open_arrow(*layout, num_layers, layer_ids)
        config = _metadata(data_dir, "data_config.json") or {}
        captured = (config.get("hidden_states") or {}).get("layer_ids") or [2, num_layers // 2, num_layers - 3]
        # speculators 0.3-0.4 captures layer outputs
        return TrainingData("speculators", _speculators_files(data_dir), layer_ids or [i + 1 for i in captured[:3]],
                            last_hidden_state_normed=False)
    if data_format == "specforge":
        return TrainingData("specforge", _specforge_files(data_dir), layer_ids or default_layer_ids(num_layers),
                            last_hidden_state_normed=True)
    raise ValueError(f"unknown data format {data_format!r}; expected auto or one of {', '.join(DATA_FORMATS)}")


def _open_arrow(dataset_dir: Path, hs_dir: Path, num_layers: int, layer_ids: list[int] | None) -> TrainingData:
    files = _hs_files(hs_dir)
    notes: list[str] = []
    if not layer_ids:
        with open(files[0], "rb") as file:
            recorded = SampleFile(file, files[0], HS_FILE_KEYS, "a speculators >= 0.5 hidden-states file").metadata
        if LAYER_IDS_METADATA_KEY not in recorded:
            raise ValueError(
                f"{dataset_dir} is speculators >= 0.5 data, which records no layer ids: {files[0]} has no "
                f"{LAYER_IDS_METADATA_KEY!r} metadata. Pass --layer-ids: the ids vLLM captured, as given "
                f"(launch_vllm.py --target-layer-ids; its default for this {num_layers}-layer verifier is "
                f"{','.join(map(str, [2, num_layers // 2, num_layers - 3]))}, or with the last layer it appends "
                f"{' '.join(map(str, [2, num_layers // 2, num_layers - 3, num_layers]))})")
        try:
            ids = parse_layer_ids(str(recorded[LAYER_IDS_METADATA_KEY]))
        except ValueError as error:
            raise ValueError(f"{files[0]}: {LAYER_IDS_METADATA_KEY!r} metadata: {error}") from None
        layer_ids, note = capture_layer_ids(ids, num_layers, f"{files[0].name}'s {LAYER_IDS_METADATA_KEY}")
        notes = [note] if note else []
    arrow = ArrowRows(dataset_dir)
    _check_hs_numbering(files, hs_dir, len(arrow), dataset_dir)
    return TrainingData("speculators", files, layer_ids, last_hidden_state_normed=False, arrow=arrow, notes=notes)
