"""A torchrun job whose rank 1 raises a ValueError after a few steps from a main NOT wrapped in torch elastic's
@record, so it leaves no error file and torchrun's summary shows only torch's placeholder link; rank 0 waits to be
stopped. With JOIN_GROUP=1 the ranks join a gloo process group first (torch then prefixes an uncaught exception's
lines with `[rankN]: `)."""

import os
import time


def load_shard(rank: int) -> None:
    raise ValueError(f"shard {rank}: 3 columns, expected 4")


def main() -> None:
    if os.environ.get("JOIN_GROUP") == "1":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    for step in range(1, 4):
        print(f"rank {rank} step {step}", flush=True)
        time.sleep(0.1)
    if rank == 1:
        load_shard(rank)
    time.sleep(60)


main()
