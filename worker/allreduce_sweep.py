"""NCCL all-reduce time by message size on this host's GPUs: what `longrun hosts probe-interconnect` runs there.

    python allreduce_sweep.py --tp 2|all [--sizes 1024,4096,...] [--iters 50] [--repeats 5]

Runs on the host with the host's python that has torch (the worker ships this file beside the host agent); it
imports nothing of longrun. It starts tp processes (torch.multiprocessing spawn), one per GPU, joined by NCCL.
For each message size (bf16 values) it times `iters` all-reduces issued back to back between two CUDA events,
takes the median of `repeats` such timings and the slowest rank's, and reports the time per call in µs: what a
tensor-parallel decode, which issues its all-reduces in one stream of kernels, pays per call.

Prints one JSON line: {"world", "gpus": [names], "gpu_count", "allreduce": [{"bytes", "us"}], "nccl_env"} or,
when it cannot measure (no torch, no CUDA, fewer GPUs than tp), {"error", "gpu_count"} with exit status 3.
benchmarks/decode_tp.py calls allreduce_table() inside its own process group.
"""

from __future__ import annotations  # hosts may run Python 3.8

import argparse
import json
import os
import socket
import statistics
import sys
import time

# decode messages ((tokens verified) x hidden x 2 bytes) are a few KiB to a few MiB; 16 and 64 MiB for reference
DEFAULT_SIZES = [1 << k for k in range(10, 23)] + [16 << 20, 64 << 20]
CANNOT_MEASURE = 3


def allreduce_table(sizes: list[int], iters: int = 50, repeats: int = 5, warmup: int = 5) -> list[dict]:
    """[{"bytes", "us"}] on the current process group; every rank calls it and gets the table. On CUDA the calls
    are timed between CUDA events on the current device; on CPU (gloo: tests and smoke runs) by the clock."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    table = []
    for nbytes in sizes:
        buffer = torch.ones(max(nbytes // 2, 1), dtype=torch.bfloat16, device=device)
        for _ in range(warmup):
            dist.all_reduce(buffer)
        timings = []
        for _ in range(repeats):
            dist.barrier()
            timings.append(_per_call_us(buffer, iters, cuda))
        # the slowest rank's median: a collective ends for everyone when its last rank is done
        slowest = torch.tensor([statistics.median(timings)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        table.append({"bytes": nbytes, "us": round(float(slowest.item()), 2)})
    return table


def _per_call_us(buffer, iters: int, cuda: bool) -> float:
    """µs per all-reduce of `buffer` over `iters` calls back to back: on the GPU's clock when cuda, else ours."""
    import torch
    import torch.distributed as dist

    if not cuda:
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buffer)
        return (time.perf_counter() - start) * 1e6 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dist.all_reduce(buffer)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        table = allreduce_table(args.sizes, args.iters, args.repeats)
        if rank == 0:
            results.put(table)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep(args: argparse.Namespace) -> dict:
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as exc:
        return {"error": f"{sys.executable} cannot import torch ({exc}): register the host with a python that has "
                         "torch", "gpu_count": None}
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return {"error": f"torch ({sys.executable}) sees no CUDA GPU on this host", "gpu_count": 0}
    tp = count if args.tp == "all" else args.tp
    if count < tp:
        return {"error": f"this host has {count} GPU(s); measuring all-reduce at tp={tp} needs {tp}",
                "gpu_count": count}
    gpus = [torch.cuda.get_device_name(i) for i in range(tp)]
    if tp == 1:
        return {"world": 1, "gpus": gpus, "gpu_count": count, "allreduce": [], "nccl_env": _nccl_env()}
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(_rank, args=(tp, _free_port(), args, results), nprocs=tp, join=True)
    return {"world": tp, "gpus": gpus, "gpu_count": count, "allreduce": results.get(), "nccl_env": _nccl_env()}


def _nccl_env() -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}


def _tp(text: str) -> int | str:
    if text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError("a whole number >= 1, or all (every GPU of the host)")
    return int(text)


def _sizes(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError("give message sizes in bytes, each >= 2, comma-separated")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=_tp, required=True, help="ranks (GPUs) in the all-reduce, or all")
    p.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated")
    p.add_argument("--iters", type=int, default=50, help="calls per timing")
    p.add_argument("--repeats", type=int, default=5, help="timings per size (their median is reported)")
    args = p.parse_args(argv)
    if args.iters < 1 or args.repeats < 1:
        p.error("--iters and --repeats must be >= 1")
    result = sweep(args)
    sys.stdout.write(json.dumps(result) + "\n")
    return CANNOT_MEASURE if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
