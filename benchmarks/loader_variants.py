"""`trainer.train` with its training loader swapped, to compare loaders on the same command:

    LONGRUN_LOADER=processes python benchmarks/bench_from_disk.py --work W --out O --trainer benchmarks/loader_variants.py

LONGRUN_LOADER:
- threads: the trainer's own loader (reader threads into pinned memory), unchanged;
- processes: torch's DataLoader with --num-workers worker processes and its pinning thread, prefetch 4
  (what the trainer used before); workers hand each batch over in shared memory;
- processes-unpinned: the same without pinning (the GPU copies from pageable memory);
- memory: the first 8 batches read once into pinned memory and repeated (no disk, no loader: the bound).
"""

import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import trainer.train as train  # noqa: E402
from trainer.data import HiddenStatesDataset, make_loader  # noqa: E402

VARIANT = os.environ.get("LONGRUN_LOADER", "threads")


class InSharedMemory:
    """HiddenStatesDataset for DataLoader: a batch per call, put in shared memory for the hand-over."""

    def __init__(self, dataset: HiddenStatesDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices):
        return {k: v.share_memory_() for k, v in self.dataset.read_batch(indices).items()}


class InMemory:
    def __init__(self, dataset: HiddenStatesDataset, batch_sampler):
        self.batch_sampler = batch_sampler
        self.batches = [dataset.read_batch(i, pin=torch.cuda.is_available()) for i in list(batch_sampler)[:8]]

    def __iter__(self):
        for i in range(len(self.batch_sampler)):
            yield self.batches[i % len(self.batches)]


def training_loader(dataset, batch_size, num_workers=0, *args, **kwargs):
    loader = make_loader(dataset, batch_size, num_workers, *args, **kwargs)
    if num_workers == 0 or VARIANT == "threads":  # validation reads in line in every variant
        return loader
    if VARIANT == "memory":
        return InMemory(dataset, loader.batch_sampler)
    if VARIANT in ("processes", "processes-unpinned"):
        return DataLoader(InSharedMemory(dataset), batch_sampler=loader.batch_sampler, num_workers=num_workers,
                          collate_fn=lambda batch: batch, pin_memory=VARIANT == "processes" and torch.cuda.is_available(),
                          persistent_workers=True, prefetch_factor=4)
    raise SystemExit(f"LONGRUN_LOADER={VARIANT!r}: choose threads, processes, processes-unpinned or memory")


train.make_loader = training_loader
print(f"training loader: {VARIANT}", flush=True)
sys.exit(train.main())
