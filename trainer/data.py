"""Streaming the per-sample files written by `trainer.prepare` into padded batches, sharded per rank.

A batch from `collate` / `make_loader`:
- `input_ids` int64 [B, S] (0 on pads), `loss_mask` uint8 [B, S] (0 on pads), `attention_mask` int64 [B, S]
  (1 on real tokens), `hidden_states` bf16 [B, S, 3H], `last_hidden_state` bf16 [B, S, H] (zeros on pads).
"""

import json
import math
import random
import signal
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import BinaryIO

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

SAMPLE_PATTERN = "sample_*.safetensors"
TENSOR_NAMES = ("input_ids", "loss_mask", "hidden_states", "last_hidden_state")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
           "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


class SampleFile:
    """One open per-sample safetensors file, read row-wise straight into a caller's buffer.

    safetensors stores each tensor row-major at a known offset, so the first n rows are one contiguous
    range: `read_rows` puts them where they belong with a single `readinto`, with no intermediate tensor."""

    def __init__(self, file: BinaryIO, path: Path):
        self.file, self.path = file, path
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size))
        self.base = 8 + size
        self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
        missing = set(TENSOR_NAMES) - set(self.entries)
        if missing:
            raise KeyError(f"{path} lacks {sorted(missing)}: not a sample written by `trainer.prepare`")

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


def _empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A buffer for a batch tensor; inside a loader worker, in shared memory, so handing it to the
    training process costs no copy (what torch's default_collate does)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))
    return torch.empty(0, dtype=dtype).new(storage).resize_(shape)


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
        self, data_dir: str | Path | None, max_seq_len: int, files: Sequence[str | Path] | None = None
    ):
        self.files = [Path(f) for f in files] if files is not None else list_samples(data_dir)
        if files is None and not self.files:
            raise FileNotFoundError(
                f"no {SAMPLE_PATTERN} files in {data_dir}; run `python -m trainer.prepare` first"
            )
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        batch = self.__getitems__([index])  # one sample: nothing is padded
        return {name: batch[name][0] for name in TENSOR_NAMES}

    def __getitems__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """The padded batch of these samples, as `collate` makes it, read from disk straight into place.

        DataLoader calls this for a whole batch; reading only the first max_seq_len rows of each file."""
        with ExitStack() as files:
            samples = [SampleFile(files.enter_context(open(self.files[i], "rb", buffering=0)), self.files[i])
                       for i in indices]
            lengths = [min(s.rows("input_ids"), self.max_seq_len) for s in samples]
            longest = max(lengths)
            out: dict[str, torch.Tensor] = {}
            for name in TENSOR_NAMES:
                dtype, row_shape = samples[0].dtype_and_row_shape(name)
                out[name] = _empty((len(samples), longest, *row_shape), dtype)
                for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
                    sample.read_rows(name, out[name][row, :length])
                    out[name][row, length:] = 0
        positions = torch.arange(longest)
        out["attention_mask"] = (positions[None, :] < torch.tensor(lengths)[:, None]).long()
        return out


def collate(batch: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every tensor to the longest sample; pads have loss_mask 0 and attention_mask 0."""
    lengths = [item["input_ids"].shape[0] for item in batch]
    longest = max(lengths)
    out: dict[str, torch.Tensor] = {}
    for name in TENSOR_NAMES:
        first = batch[0][name]
        padded = first.new_zeros((len(batch), longest, *first.shape[1:]))
        for row, item in enumerate(batch):
            padded[row, : lengths[row]] = item[name]
        out[name] = padded
    positions = torch.arange(longest)
    out["attention_mask"] = (positions[None, :] < torch.tensor(lengths)[:, None]).long()
    return out


def _leave_sigterm_to_the_trainer(worker_id: int) -> None:
    # A cancel signals every process of the run. A worker that died of it would make its rank raise
    # mid-step while the other ranks wait in a collective; the rank stops cleanly and ends its workers
    # itself (and workers also exit when their rank dies).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _collate_unless_collated(batch: Sequence[dict[str, torch.Tensor]] | dict[str, torch.Tensor]) -> dict:
    # HiddenStatesDataset.__getitems__ returns the batch already padded; other datasets give a list of items
    return batch if isinstance(batch, dict) else collate(batch)


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

    def _batches(self) -> list[list[int]]:
        if self.num_samples == 0:
            return []
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
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
        yield from self._batches()[self.start_batch :]

    def __len__(self) -> int:
        return max(0, len(self._batches()) - self.start_batch)


def make_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    epoch: int = 0,
    start_batch: int = 0,
    even_batches: bool = True,
) -> DataLoader:
    """A DataLoader over this rank's shard, pinned and prefetching so the GPU does not wait on the disk.

    Its `batch_sampler` is a `ShardBatchSampler` (see there for how ranks are kept in step): call
    `loader.batch_sampler.set_epoch(e)` between epochs (workers persist across epochs), or build a new
    loader per epoch. `start_batch` skips batches of the first epoch without reading them (resume).
    """
    sampler = ShardBatchSampler(
        len(dataset), batch_size, shuffle, seed, rank, world_size, epoch, start_batch, even_batches
    )
    workers = num_workers > 0
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate_unless_collated,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=workers,
        worker_init_fn=_leave_sigterm_to_the_trainer,
        prefetch_factor=4 if workers else None,
    )
