"""Streaming the per-sample files written by `trainer.prepare` into padded batches, sharded per rank.

A batch from `make_loader`:
- `input_ids` int64 [B, S] (0 on pads), `loss_mask` uint8 [B, S] (0 on pads), `attention_mask` int64 [B, S]
  (1 on real tokens), `hidden_states` bf16 [B, S, 3H], `last_hidden_state` bf16 [B, S, H] (zeros on pads).
- with `pack=True` each row holds several samples one after another, up to max_seq_len tokens, and the
  batch adds `position_ids` int64 [B, S] (restarting at 0 for each sample, and for the pad tail) and
  `documents`: per row, the lengths of its samples (the pad tail counted as one more), a tuple of ints.
- features stored in FP8 (`prepare --store-dtype fp8`, speculators' FP8 connector) come as float8_e4m3fn with
  `hidden_states_scale` / `last_hidden_state_scale` float32 [B, S, 1], one scale per token; `batch_to`
  dequantizes them on the device, so the copy to the GPU moves half the bytes as well.
"""

import json
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import BinaryIO

import torch
from torch.utils.data import Dataset, Sampler

SAMPLE_PATTERN = "sample_*.safetensors"
TENSOR_NAMES = ("input_ids", "loss_mask", "hidden_states", "last_hidden_state")
# read when every sample of a batch has it: the verifier's top-1 token id at each position (int32 [S]),
# which `prepare` stores and other tools' data lacks
# and the per-token scales of features stored in FP8 (FP8_SCALES: feature -> its scale)
FP8_SCALES = {"hidden_states": "hidden_states_scale", "last_hidden_state": "last_hidden_state_scale"}
OPTIONAL_TENSOR_NAMES = ("verifier_top_ids", *FP8_SCALES.values())
FP8_DTYPE = torch.float8_e4m3fn
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
           "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": FP8_DTYPE}


def quantize_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn tensor, float32 scale [S, 1]): one scale per row (token), amax / 448, as speculators'
    hs_connectors.fp8_utils does. Per token rather than per tensor: a few tokens (the first, separators)
    carry activations 100x the rest, and one scale for the file would leave the others a few FP8 steps."""
    fp32 = tensor.float()
    scale = (fp32.abs().amax(dim=-1, keepdim=True) / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)
    return (fp32 / scale).to(FP8_DTYPE), scale


def dequantize(batch: dict, dtype: torch.dtype) -> dict:
    """The batch with FP8 features multiplied back by their scales (in `dtype`), the scales dropped."""
    out = dict(batch)
    for name, scale in FP8_SCALES.items():
        if scale in out:
            out[name] = out[name].to(dtype) * out.pop(scale).to(dtype)
    return out


class SampleFile:
    """One open per-sample safetensors file, read row-wise straight into a caller's buffer.

    safetensors stores each tensor row-major at a known offset, so the first n rows are one contiguous
    range: `read_rows` puts them where they belong with a single `readinto`, with no intermediate tensor."""

    def __init__(self, file: BinaryIO, path: Path, required: Sequence[str] = TENSOR_NAMES,
                 layout: str = "a sample written by `trainer.prepare`"):
        self.file, self.path = file, path
        try:
            size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(size))
        except (ValueError, MemoryError, OverflowError) as error:
            raise ValueError(f"{path}: not a safetensors file ({error}): not {layout}") from None
        self.base = 8 + size
        self.metadata = header.get("__metadata__") or {}
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        missing = set(required) - set(self.entries)
        if missing:
            raise KeyError(f"{path} lacks {sorted(missing)}: not {layout} (it holds {sorted(self.entries)})")
        unknown = {v["dtype"] for v in self.entries.values()} - set(_DTYPES)
        if unknown:
            raise ValueError(f"{path}: tensors of dtype {sorted(unknown)}, which the trainer does not read")

    def rows(self, name: str) -> int:
        return self.entries[name]["shape"][0]

    def dtype_and_row_shape(self, name: str) -> tuple[torch.dtype, list[int]]:
        return _DTYPES[self.entries[name]["dtype"]], self.entries[name]["shape"][1:]

    def read_rows(self, name: str, out: torch.Tensor) -> None:
        """Fill the contiguous `out` (shape [n, *row_shape]) with the tensor's first n rows."""
        nbytes = out.numel() * out.element_size()
        self.file.seek(self.base + self.entries[name]["data_offsets"][0])
        if nbytes and self.file.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) != nbytes:
            raise OSError(f"{self.path}: short read of {name}")


class FeatureWidths:
    """The per-token widths every sample's features must have, 3H (three captured layers) and H (the last): H is
    the verifier's hidden size when given, else that of the first sample read. A sample of another size is named
    with its shapes, rather than failing later in the draft as a bare matrix-shape error."""

    def __init__(self, hidden_size: int | None = None):
        self.hidden_size = hidden_size
        self.source = f"the verifier's hidden_size {hidden_size}" if hidden_size else ""
        self.lock = threading.Lock()

    def check(self, path: Path, hidden_width: int, last_width: int, stored: str) -> None:
        """`stored` says what the file holds (its tensors' shapes), for the error."""
        with self.lock:
            if self.hidden_size is None and hidden_width == 3 * last_width:
                self.hidden_size, self.source = last_width, f"hidden size {last_width}, as in {path}"
        size = self.hidden_size
        if size is None or (hidden_width, last_width) != (3 * size, size):
            expected = (f"[3 x {size} = {3 * size}] and [{size}] per token ({self.source})" if size else
                        f"3 x its last hidden state's width, {3 * last_width}")
            raise ValueError(f"{path}: {stored}: features {hidden_width} and {last_width} wide, expected {expected}; "
                             "one dataset, one verifier")


def list_samples(data_dir: str | Path) -> list[Path]:
    """Sample files in `data_dir` (or in `data_dir/hidden_states`, the layout `prepare` writes), sorted."""
    data_dir = Path(data_dir)
    files = sorted(data_dir.glob(SAMPLE_PATTERN))
    if not files and (data_dir / "hidden_states").is_dir():
        files = sorted((data_dir / "hidden_states").glob(SAMPLE_PATTERN))
    return files


def split_files(
    data_dir_or_files: str | Path | Sequence[str | Path], val_ratio: float, seed: int = 0
) -> tuple[list[Path], list[Path]]:
    """Deterministic, disjoint (train, val) split of the sample files, each sorted.

    The validation split has round(n * val_ratio) files, at least one when val_ratio > 0 and n >= 2,
    and never all of them.
    """
    if isinstance(data_dir_or_files, str | Path):
        files = list_samples(data_dir_or_files)
    else:
        files = sorted(Path(f) for f in data_dir_or_files)
    if not 0 <= val_ratio < 1:
        raise ValueError(f"val_ratio must be in [0, 1), got {val_ratio}")
    n_val = round(len(files) * val_ratio)
    if val_ratio > 0 and len(files) >= 2:
        n_val = min(max(n_val, 1), len(files) - 1)
    shuffled = files[:]
    random.Random(seed).shuffle(shuffled)
    val = set(shuffled[:n_val])
    return [f for f in files if f not in val], [f for f in files if f in val]


class HiddenStatesDataset(Dataset):
    """Map-style dataset over per-sample files; each item is a dict of the four tensors, cut to max_seq_len."""

    def __init__(
        self, data_dir: str | Path | None, max_seq_len: int, files: Sequence[str | Path] | None = None,
        hidden_size: int | None = None,
    ):
        self.files = [Path(f) for f in files] if files is not None else list_samples(data_dir)
        if files is None and not self.files:
            raise FileNotFoundError(
                f"no {SAMPLE_PATTERN} files in {data_dir}; run `python -m trainer.prepare` first"
            )
        self.max_seq_len = max_seq_len
        self.widths = FeatureWidths(hidden_size)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        batch = self.read_batch([index])  # one sample: nothing is padded
        return {name: batch[name][0] for name in (*TENSOR_NAMES, *OPTIONAL_TENSOR_NAMES) if name in batch}

    def lengths(self) -> list[int]:
        """Each sample's length after the cut to max_seq_len, from the file headers only."""
        lengths = []
        for path in self.files:
            with open(path, "rb") as file:
                lengths.append(min(SampleFile(file, path).rows("input_ids"), self.max_seq_len))
        return lengths

    def read_batch(self, indices: Sequence[int], pin: bool = False) -> dict[str, torch.Tensor]:
        """The batch of these samples, one per row right-padded to the longest, read from disk straight into
        place (into pinned memory when `pin`): only the first max_seq_len rows of each file."""
        return self._read_rows([[i] for i in indices], pin)[0]

    def read_packed_batch(self, rows: Sequence[Sequence[int]], pin: bool = False) -> dict:
        """Each row the listed samples one after another (each cut to max_seq_len), with `position_ids`
        and `documents` (see the module docstring)."""
        out, row_lengths = self._read_rows(rows, pin)
        longest = out["input_ids"].shape[1]
        documents = tuple(tuple(lengths) + ((longest - sum(lengths),) if sum(lengths) < longest else ())
                          for lengths in row_lengths)
        out["position_ids"] = torch.empty((len(rows), longest), dtype=torch.long, pin_memory=pin)
        for row, lengths in enumerate(documents):
            out["position_ids"][row] = torch.cat([torch.arange(length) for length in lengths])
        out["documents"] = documents
        return out

    def _read_rows(self, rows: Sequence[Sequence[int]], pin: bool) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        """(the padded batch whose rows are these samples concatenated, each row's sample lengths)."""
        with ExitStack() as files:
            samples = [[SampleFile(files.enter_context(open(self.files[i], "rb", buffering=0)), self.files[i])
                        for i in row] for row in rows]
            lengths = [[min(s.rows("input_ids"), self.max_seq_len) for s in row] for row in samples]
            longest = max(sum(row) for row in lengths)
            for sample in (s for row in samples for s in row):
                hidden, last = (sample.dtype_and_row_shape(name)[1] for name in ("hidden_states", "last_hidden_state"))
                self.widths.check(sample.path, hidden[-1] if hidden else 0, last[-1] if last else 0,
                                  f"hidden_states {[sample.rows('hidden_states'), *hidden]}, last_hidden_state "
                                  f"{[sample.rows('last_hidden_state'), *last]}")
            out: dict[str, torch.Tensor] = {}
            optional = [name for name in OPTIONAL_TENSOR_NAMES if all(name in f.entries for row in samples for f in row)]
            for name in (*TENSOR_NAMES, *optional):
                dtype, row_shape = samples[0][0].dtype_and_row_shape(name)
                for sample in (s for row in samples for s in row):
                    if sample.dtype_and_row_shape(name) != (dtype, row_shape):
                        raise ValueError(f"{sample.path}: {name} is {sample.dtype_and_row_shape(name)}, "
                                         f"{samples[0][0].path} {(dtype, row_shape)}: one dataset, one storage")
                out[name] = torch.empty((len(rows), longest, *row_shape), dtype=dtype, pin_memory=pin)
                for row, (row_samples, row_lengths) in enumerate(zip(samples, lengths, strict=True)):
                    start = 0
                    for sample, length in zip(row_samples, row_lengths, strict=True):
                        sample.read_rows(name, out[name][row, start : start + length])
                        start += length
                    out[name][row, start:] = 0
        out["attention_mask"] = torch.zeros((len(rows), longest), dtype=torch.long, pin_memory=pin)
        for row, row_lengths in enumerate(lengths):
            out["attention_mask"][row, : sum(row_lengths)] = 1
        return out, lengths


def shard_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The sample order of an epoch, the same on every rank (seed + epoch)."""
    if not shuffle:
        return list(range(num_samples))
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


class ShardBatchSampler(Sampler[list[int]]):
    """Batches of one rank's shard of the data; all ranks take the same number of batches.

    All ranks draw the same permutation (seed + epoch) and rank r takes positions r, r + W, ... The shards
    differ by at most one sample and are split into the same number of batches, ceil(ceil(n / W) / B), of at
    most B samples each, so every sample is seen exactly once and DDP ranks stay in step. Only when a short
    shard has fewer samples than that batch count (batch_size 1 with n not divisible by W, or n < W) does it
    repeat samples from the start of the permutation, as DistributedSampler does; `even_batches=False`
    refuses that and lets batch counts differ instead.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        epoch: int = 0,
        start_batch: int = 0,
        even_batches: bool = True,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.epoch, self.start_batch, self.even_batches = epoch, start_batch, even_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration yields epoch `epoch`'s order, skipping its first `start_batch` batches (resume)."""
        self.epoch, self.start_batch = epoch, start_batch

    def batches_in_epoch(self, epoch: int) -> int:
        return len(self._batches(epoch))

    def _batches(self, epoch: int) -> list[list[int]]:
        if self.num_samples == 0:
            return []
        order = shard_order(self.num_samples, self.shuffle, self.seed, epoch)
        shard = order[self.rank :: self.world_size]
        largest_shard = -(-self.num_samples // self.world_size)
        count = -(-largest_shard // self.batch_size)
        if len(shard) < count:
            if not self.even_batches:
                count = len(shard)
            else:
                cycled = order * -(-largest_shard * self.world_size // self.num_samples)
                shard = cycled[: largest_shard * self.world_size][self.rank :: self.world_size][:count]
        if count == 0:
            return []
        bounds = [len(shard) * i // count for i in range(count + 1)]
        return [shard[bounds[i] : bounds[i + 1]] for i in range(count)]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches(self.epoch)[self.start_batch :]

    def __len__(self) -> int:
        return max(0, len(self._batches(self.epoch)) - self.start_batch)


class PackedBatchSampler(Sampler[list[list[int]]]):
    """Batches of packed rows from one rank's shard: each row is consecutive samples of the shard whose
    lengths add up to at most `max_seq_len` (a longer sample, cut to it, fills a row alone).

    Ranks shard the epoch's permutation as `ShardBatchSampler` does. Every rank packs every rank's shard
    (lengths are known to all), so all take the same number of batches: a rank with fewer repeats its first
    ones, as DDP needs every rank in step."""

    def __init__(self, lengths: Sequence[int], max_seq_len: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 rank: int = 0, world_size: int = 1, epoch: int = 0, start_batch: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.lengths, self.max_seq_len, self.batch_size = [min(n, max_seq_len) for n in lengths], max_seq_len, batch_size
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.epoch, self.start_batch = epoch, start_batch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """The next iteration yields epoch `epoch`'s order, skipping its first `start_batch` batches (resume)."""
        self.epoch, self.start_batch = epoch, start_batch

    def _pack(self, shard: Sequence[int]) -> list[list[list[int]]]:
        rows: list[list[int]] = []
        used = self.max_seq_len
        for index in shard:
            if used + self.lengths[index] > self.max_seq_len:
                rows.append([])
                used = 0
            rows[-1].append(index)
            used += self.lengths[index]
        return [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]

    def batches_in_epoch(self, epoch: int) -> int:
        """Packing follows the epoch's order, so the count can differ from epoch to epoch."""
        return len(self._batches(epoch))

    def _batches(self, epoch: int) -> list[list[list[int]]]:
        order = shard_order(len(self.lengths), self.shuffle, self.seed, epoch)
        every_rank = [self._pack(order[r :: self.world_size]) for r in range(self.world_size)]
        own, count = every_rank[self.rank], max(len(batches) for batches in every_rank)
        if count and not own:
            raise ValueError(f"{len(self.lengths)} samples leave rank {self.rank} of {self.world_size} without any")
        return [own[i % len(own)] for i in range(count)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        yield from self._batches(self.epoch)[self.start_batch :]

    def __len__(self) -> int:
        return max(0, len(self._batches(self.epoch)) - self.start_batch)


def batch_bytes(batch: dict) -> int:
    """The bytes of a batch's tensors (what a read brought in)."""
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class ReaderSizing:
    """How a loader sizes its readers and read-ahead from what it measures, when the user gave no --num-workers.

    After `skip` batches (the first steps compile) and `probe` more, it compares the rate training takes bytes at
    (a batch's bytes over a batch's compute time: the trainer's measure when it gives one, `observe_step`, else
    the time between the consumer's requests) with the rate its readers give (bytes over seconds spent in reads,
    per reader, times the readers). When training needs more, it raises the readers to what the need and
    `margin` call for, at most `max_readers`, and the read-ahead to 4 batches per reader, at most
    `max_read_ahead_bytes` of batches held (pinned memory on a GPU). It says what it chose and why in one line
    (`log`), and once more after as many batches again, when the raise has not closed the gap."""

    max_readers: int = 16
    max_read_ahead_bytes: int = 8 << 30
    # torch.compile is still compiling at step 10 (benchmarks/bench_from_disk.py): measured steps come after
    skip: int = 20
    probe: int = 10
    # a reader's rate falls as readers are added on one disk (0.79 GB/s each with 2 on the H200 machine, 0.53 with 3)
    margin: float = 1.5
    log: Callable[[str], None] = print

    @classmethod
    def for_this_host(cls, log: Callable[[str], None] = print) -> "ReaderSizing":
        """Read-ahead of at most 1/8 of the host's memory shared by its local ranks (8 GiB at most per rank)."""
        memory, ranks = physical_memory(), max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        cap = min(8 << 30, memory // 8 // ranks) if memory else 8 << 30
        return cls(max_read_ahead_bytes=cap, log=log)


class _Gate:
    """At most `limit` reads at once; the limit can be raised while reads wait."""

    def __init__(self, limit: int):
        self.limit, self.busy = limit, 0
        self.changed = threading.Condition()

    def __enter__(self) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.busy < self.limit)
            self.busy += 1

    def __exit__(self, *exc) -> None:
        with self.changed:
            self.busy -= 1
            self.changed.notify_all()

    def widen(self, limit: int) -> None:
        with self.changed:
            self.limit = limit
            self.changed.notify_all()


def _gb(rate: float) -> str:
    return f"{rate / 1e9:.2f} GB/s"


class BatchLoader:
    """This rank's batches, read ahead by `num_workers` threads straight into pinned memory (when a GPU is
    present); iterate it once per epoch after `batch_sampler.set_epoch(e)`.

    Reading a sample is a few `readinto` calls, which release the GIL, so threads read in parallel. Worker
    processes (torch's DataLoader) cost the training process more than the read: each batch is handed over
    through shared memory and copied again by a pinning thread, and on an H200 that left the GPU idle for
    5 of every 40 ms (benchmarks: "Training from disk"). With 0 workers, batches are read in line.

    With `sizing` (a ReaderSizing) the readers and the read-ahead grow, in the first epoch's first steps, to
    what the measured read rate and step time call for; `chosen` then says what was chosen and why."""

    def __init__(self, dataset: HiddenStatesDataset, batch_sampler: ShardBatchSampler | PackedBatchSampler,
                 num_workers: int, read_ahead: int, pin: bool, sizing: ReaderSizing | None = None):
        self.dataset, self.batch_sampler = dataset, batch_sampler
        self.num_workers, self.read_ahead, self.pin = num_workers, max(1, read_ahead), pin
        self.sizing = sizing if num_workers > 0 else None
        self.chosen: str | None = None
        self._lock = threading.Lock()
        self._reads: list[tuple[int, float]] = []  # (bytes, seconds) of each read, in the order they ended
        self._consumed: list[float] = []  # the consumer's time per batch, between its requests
        self._observed: list[float] = []  # the trainer's compute time per batch (observe_step)
        self._checks = 0  # decisions made: at most 2 (the choice, and whether it closed the gap)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def observe_step(self, busy_s: float) -> None:
        """The trainer's compute time for one batch (its measure of a step, less the wait for data, per batch)."""
        if self.sizing is not None and self._checks < 2:
            self._observed.append(busy_s)

    def _timed(self, read: Callable[[object], dict], gate: _Gate, indices: object) -> dict:
        with gate:
            started = time.perf_counter()
            batch = read(indices)
            took = time.perf_counter() - started
        if self.sizing is not None and self._checks < 2:
            with self._lock:
                self._reads.append((batch_bytes(batch), took))
        return batch

    def _size(self, gate: _Gate) -> None:
        """Compare the rate training needs with the readers' and raise these (see ReaderSizing)."""
        sizing = self.sizing
        with self._lock:
            reads = self._reads[sizing.skip:] or self._reads
        compute = (self._observed[sizing.skip:] or self._observed or
                   self._consumed[sizing.skip:] or self._consumed)
        if not reads or not compute:
            return
        self._checks += 1
        per_batch = sum(b for b, _ in reads) / len(reads)
        per_reader = sum(b for b, _ in reads) / max(sum(t for _, t in reads), 1e-9)
        step = sorted(compute)[len(compute) // 2]
        needed, given = per_batch / max(step, 1e-9), per_reader * self.num_workers
        figures = (f"a batch is {per_batch / 1e6:.1f} MB and takes {step * 1e3:.1f} ms to train: "
                   f"{_gb(needed)} needed; {self.num_workers} reader(s) give {_gb(given)} ({_gb(per_reader)} each)")
        wanted = min(sizing.max_readers, math.ceil(needed * sizing.margin / max(per_reader, 1e-9)))
        if self._checks == 2:  # after a raise: did it close the gap?
            if needed > given:
                self.chosen = (f"readers: still input-bound at {self.num_workers} readers: {figures}; the disk is the "
                               "bound: store the features in FP8 (prepare --store-dtype fp8) to halve the bytes")
                sizing.log(self.chosen)
            return
        if wanted <= self.num_workers:
            self._checks = 2
            self.chosen = f"readers: {self.num_workers} reader(s), {self.read_ahead} batches ahead, are enough: {figures}"
            sizing.log(self.chosen)
            return
        readers = wanted
        ahead = max(self.read_ahead, min(4 * readers, int(sizing.max_read_ahead_bytes // max(per_batch, 1))))
        capped = " (the cap)" if readers == sizing.max_readers else ""
        self.chosen = (f"readers: {self.num_workers} -> {readers}{capped}, read-ahead {self.read_ahead} -> {ahead} "
                       f"batches ({ahead * per_batch / 1e9:.1f} GB held, at most {sizing.max_read_ahead_bytes / 2**30:.1f} "
                       f"GiB): {figures}; --num-workers N fixes them")
        sizing.log(self.chosen)
        self.num_workers, self.read_ahead = readers, ahead
        gate.widen(readers)
        with self._lock:
            self._reads.clear()
        self._consumed.clear()
        self._observed.clear()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        packed = isinstance(self.batch_sampler, PackedBatchSampler)
        read = partial(self.dataset.read_packed_batch if packed else self.dataset.read_batch, pin=self.pin)
        if self.num_workers == 0:
            yield from map(read, self.batch_sampler)
            return
        batches = iter(self.batch_sampler)
        sizing = self.sizing if self._checks < 2 else None
        gate = _Gate(self.num_workers)
        threads = max(self.num_workers, sizing.max_readers if sizing else 0)
        with ThreadPoolExecutor(threads, thread_name_prefix="longrun-reader") as pool:
            submit = partial(pool.submit, self._timed, read, gate)
            pending = deque(submit(indices) for indices in islice(batches, self.read_ahead))
            try:
                while pending:
                    batch = pending.popleft().result()
                    for indices in islice(batches, self.read_ahead - len(pending)):
                        pending.append(submit(indices))
                    handed = time.perf_counter()
                    yield batch
                    if sizing is not None and self._checks < 2:
                        self._consumed.append(time.perf_counter() - handed)
                        if len(self._consumed) >= sizing.skip + sizing.probe:
                            self._size(gate)
            finally:  # an epoch left early (a stop) waits only for the reads already running
                for future in pending:
                    future.cancel()


def make_loader(
    dataset: HiddenStatesDataset,
    batch_size: int,
    num_workers: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    start_batch: int = 0,
    even_batches: bool = True,
    pack: bool = False,
    sizing: ReaderSizing | None = None,
) -> BatchLoader:
    """A loader over this rank's shard that reads `4 * num_workers` batches ahead, into pinned memory when
    a GPU is present, so the GPU does not wait on the disk.

    Its `batch_sampler` is a `ShardBatchSampler`, or with `pack` a `PackedBatchSampler` whose batches are
    `batch_size` rows of packed samples (see each for how ranks are kept in step): call
    `loader.batch_sampler.set_epoch(e)` between epochs. `start_batch` skips batches of the first epoch
    without reading them (resume). The dataset needs `read_batch(indices, pin)`, and with `pack`
    `lengths()` and `read_packed_batch(rows, pin)`. With `sizing`, the readers and the read-ahead grow from
    `num_workers` to what the measured read rate calls for (ReaderSizing).
    """
    if pack:
        sampler = PackedBatchSampler(dataset.lengths(), dataset.max_seq_len, batch_size, shuffle, seed, rank,
                                     world_size, epoch, start_batch)
    else:
        sampler = ShardBatchSampler(
            len(dataset), batch_size, shuffle, seed, rank, world_size, epoch, start_batch, even_batches
        )
    return BatchLoader(dataset, sampler, num_workers, 4 * num_workers, pin=torch.cuda.is_available(), sizing=sizing)


def batch_to(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The batch on `device`, features cast to `dtype`; values that are not tensors (`documents`) as they are."""
    out = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out = dequantize(out, dtype)
    for name in ("hidden_states", "last_hidden_state"):
        out[name] = out[name].to(dtype)
    return out


def prefetch_to_device(loader: Iterable[dict], device: torch.device, dtype: torch.dtype,
                       plan: Callable[[dict], dict] | None = None) -> Iterator[dict]:
    """The loader's batches on `device`; on a GPU, batch i+1 is copied on a side stream while step i runs.

    A 4096-token sample of an 8B verifier carries ~130 MB of features: copied in line, that is milliseconds
    of idle GPU every step. `plan(batch)` adds entries computed from the batch while it is still on the CPU
    (`ttt.plan_trained_rows`)."""

    def staged(batch: dict) -> dict:
        return batch_to({**batch, **plan(batch)} if plan else batch, device, dtype)

    if device.type != "cuda":
        for batch in loader:
            yield staged(batch)
        return
    copies = torch.cuda.Stream(device)

    def issue(batch: dict | None) -> dict | None:
        if batch is None:
            return None
        with torch.cuda.stream(copies):
            return staged(batch)

    batches = iter(loader)
    pending = issue(next(batches, None))
    while pending is not None:
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(copies)
        for tensor in pending.values():
            if isinstance(tensor, torch.Tensor):
                tensor.record_stream(compute)
        batch, pending = pending, issue(next(batches, None))
        yield batch
