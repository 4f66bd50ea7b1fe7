"""A job that checkpoints after every step and resumes from its checkpoint (the trainer's contract, in a few
lines): what the fault tests kill and retry.

    torchrun --nproc-per-node 1 job_checkpointing.py --steps 60 --sleep 0.05 --checkpoint /path/ckpt.json
"""

import argparse
import json
import os
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--sleep", type=float, default=0.05)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--resumed-sleep", type=float, help="seconds per step once resumed (default --sleep): a test's "
                   "first attempt outlasts a time limit, the resumed one finishes soon")
    args = p.parse_args()
    start = json.load(open(args.checkpoint))["step"] if os.path.exists(args.checkpoint) else 0
    print(f"resuming after step {start}" if start else "starting at step 1", flush=True)
    sleep = args.resumed_sleep if start and args.resumed_sleep is not None else args.sleep
    with open(os.environ["LONGRUN_METRICS_FILE"], "a") as metrics:
        for step in range(start + 1, args.steps + 1):
            time.sleep(sleep)
            metrics.write(json.dumps({"step": step, "total_steps": args.steps, "loss": 1 / step}) + "\n")
            metrics.flush()
            with open(args.checkpoint + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(args.checkpoint + ".tmp", args.checkpoint)


if __name__ == "__main__":
    main()
