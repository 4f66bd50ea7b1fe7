"""A small torchrun job that reports metrics the way longrun reads them.

    torchrun --nproc-per-node 2 examples/toy_train.py --steps 200 --lr 0.05

Each rank fits a noisy linear model on its own data shard (gloo all-reduce of the gradients);
rank 0 appends one JSON line per step to $LONGRUN_METRICS_FILE.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds per step, to look like real work")
    p.add_argument("--label", default="", help="any text; echoed to the log")
    p.add_argument("--fail-at", type=int, default=0, help="exit with code 3 at this step (tests)")
    p.add_argument("--no-time", action="store_true", help="write no `time` on metric lines: the server then measures "
                   "the step time by when it reads them")
    args, extra = p.parse_known_args()

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if rank == 0:
        print("ARGV " + json.dumps(sys.argv[1:]), flush=True)
        print(f"world size {world}, pid {os.getpid()}, "
              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    torch.manual_seed(rank)
    true_w = torch.tensor([2.0, -3.0, 0.5])
    x = torch.randn(512, 3)
    y = x @ true_w + 0.1 * torch.randn(512)
    w = torch.zeros(3, requires_grad=True)
    out = open(os.environ.get("LONGRUN_METRICS_FILE", "metrics.jsonl"), "a") if rank == 0 else None
    for step in range(1, args.steps + 1):
        loss = ((x @ w - y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            if distributed:
                dist.all_reduce(w.grad)
                w.grad /= world
                dist.all_reduce(loss)
                loss /= world
            w -= args.lr * w.grad
            w.grad.zero_()
        time.sleep(args.sleep)
        if out:
            line = {"step": step, "total_steps": args.steps, "epoch": step / args.steps, "time": time.time(),
                    "loss": loss.item(), "lr": args.lr}
            if args.no_time:
                del line["time"]
            out.write(json.dumps(line) + "\n")
            out.flush()
            if step % 20 == 0 or step == args.steps:
                print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)
        if args.fail_at and step == args.fail_at:
            print("failing on purpose", flush=True)
            return 3
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
