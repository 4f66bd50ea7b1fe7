"""A small torchrun job that reports metrics the way longrun reads them, with nothing but the standard library.

    torchrun --nproc-per-node 2 examples/toy_train.py --steps 200 --lr 0.05

Each rank fits a noisy linear model (3 weights) on its own data shard by gradient descent; rank 0 appends one JSON
line per step to $LONGRUN_METRICS_FILE. torchrun starts the ranks (RANK, WORLD_SIZE from its environment); the job
needs no torch of its own, so a rank is running as soon as python is: what longrun does with it (launch, metrics,
logs, restarts, cancels) is what this job is for, not the arithmetic.
"""

import argparse
import json
import os
import random
import signal
import sys
import time


def shard(rank: int, n: int = 512) -> list[tuple[list[float], float]]:
    """This rank's data: y = x . (2, -3, 0.5) + noise."""
    rng = random.Random(rank)
    true_w = (2.0, -3.0, 0.5)
    rows = []
    for _ in range(n):
        x = [rng.gauss(0, 1) for _ in true_w]
        rows.append((x, sum(a * b for a, b in zip(x, true_w, strict=True)) + 0.1 * rng.gauss(0, 1)))
    return rows


def step(w: list[float], rows: list[tuple[list[float], float]], lr: float) -> float:
    """One gradient step on the mean squared error; the loss before it."""
    grad, loss = [0.0] * len(w), 0.0
    for x, y in rows:
        err = sum(a * b for a, b in zip(x, w, strict=True)) - y
        loss += err * err
        for i, a in enumerate(x):
            grad[i] += 2 * err * a
    for i in range(len(w)):
        w[i] -= lr * grad[i] / len(rows)
    return loss / len(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds per step, to look like real work")
    p.add_argument("--label", default="", help="any text; echoed to the log")
    p.add_argument("--fail-at", type=int, default=0, help="exit with code 3 at this step (tests)")
    p.add_argument("--no-time", action="store_true", help="write no `time` on metric lines: the server then measures "
                   "the step time by when it reads them")
    args, _ = p.parse_known_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0:
        print("ARGV " + json.dumps(sys.argv[1:]), flush=True)
        print(f"world size {world}, pid {os.getpid()}, "
              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    rows, w = shard(rank), [0.0, 0.0, 0.0]
    out = open(os.environ.get("LONGRUN_METRICS_FILE", "metrics.jsonl"), "a") if rank == 0 else None
    for n in range(1, args.steps + 1):
        loss = step(w, rows, args.lr)
        time.sleep(args.sleep)
        if out:
            line = {"step": n, "total_steps": args.steps, "epoch": n / args.steps, "time": time.time(),
                    "loss": loss, "lr": args.lr}
            if args.no_time:
                del line["time"]
            out.write(json.dumps(line) + "\n")
            out.flush()
            if n % 20 == 0 or n == args.steps:
                print(f"step {n}/{args.steps} loss {loss:.4f}", flush=True)
        if args.fail_at and n == args.fail_at:
            print("failing on purpose", flush=True)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
