"""Where a training attempt's start-up goes on one GPU: imports, building the draft, the first step (torch.compile's
warm-up) and the steps after it, each mode in a fresh process as an attempt is.

    python benchmarks/bench_startup.py                      # the demo-sized draft, 2048 positions, TTT 3 then 5
    python benchmarks/bench_startup.py --modes eager,cold,warm --ttt 3 5 --steps 30

Modes: `eager` (LONGRUN_COMPILE=0); `cold` (torch.compile with an empty inductor cache, as on a fresh machine);
`warm` (the same cache again, as a restart on the same machine finds it); `dynamic-cold`/`dynamic-warm` (the same,
with every compiled region traced with dynamic shapes from its first call instead of static first and dynamic on
the second shape); `unmarked-cold`/`unmarked-warm` (the TTT attention's count of diagonal entries left to Dynamo,
as before `trainer/attention.py` marked it dynamic: the baseline for a restart at a new TTT). Each kind of mode has
a cache of its own, shared across its TTTs: `--ttt 3 5` gives TTT=5 the cache TTT=3 left, as a restart finds it.
One JSON line per mode and TTT: seconds to import, to build the draft, of the first step, of steps 2..5, the
steady ms per step, and torch.compile's own counts (graphs compiled, recompiles, its time by phase).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.time()
ROOT = Path(__file__).resolve().parents[1]
# the demo's `small` verifier (trainer/demo_verifier.py) and the draft the trainer builds for it
DEMO = dict(hidden_size=384, intermediate_size=1024, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
            vocab_size=8192, draft_vocab_size=4096, rope_theta=10000.0, rope_scaling=None)


def child(mode: str, seq: int, ttt: int, steps: int) -> dict:
    import torch

    if mode.startswith("dynamic"):
        compile_ = torch.compile
        torch.compile = lambda fn, dynamic=None, **kw: compile_(fn, dynamic=True, **kw)
    sys.path.insert(0, str(ROOT))
    if mode.startswith("unmarked"):  # the diagonal entries' count left to Dynamo, as before trainer/attention.py marked it
        import trainer.attention

        trainer.attention._stack_steps = lambda entries: torch.stack(tuple(entries), dim=3)
    from benchmarks.bench_trainer import random_draft
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.step import TrainingStep
    from trainer.ttt import TTTObjective, plan_trained_rows

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    imported = time.time() - T0
    t = time.time()
    draft, head, target_to_draft = random_draft(DEMO, ttt, device)
    objective = TTTObjective(draft, ttt, 0.8)
    optimizer = build_optimizer(draft.parameters(), 1e-4)
    scheduler = build_scheduler(optimizer, "constant", 10**6, 0.0)
    h, v = DEMO["hidden_size"], DEMO["vocab_size"]
    batch = {"hidden_states": torch.randn(1, seq, 3 * h, device=device, dtype=dtype),
             "last_hidden_state": torch.randn(1, seq, h, device=device, dtype=dtype),
             "input_ids": torch.randint(0, v, (1, seq), device=device),
             "loss_mask": torch.ones(1, seq, dtype=torch.uint8, device=device),
             "attention_mask": torch.ones(1, seq, dtype=torch.long, device=device)}
    batch["verifier_top_ids"] = head.logits(batch["last_hidden_state"][0]).argmax(-1).int()[None]
    planned = plan_trained_rows({k: x.cpu() for k, x in batch.items()}, target_to_draft, ttt)
    batch.update(trained_rows=planned["trained_rows"].to(device), trained_counts=planned["trained_counts"])
    step = TrainingStep(objective, objective, head, optimizer, scheduler, 0.05,
                        torch.Generator(device).manual_seed(0), 0.5)
    if device.type == "cuda":
        torch.cuda.synchronize()
    built = time.time() - t

    def timed_step() -> float:
        t = time.time()
        step([batch])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.time() - t

    first = timed_step()
    early = [timed_step() for _ in range(4)]
    steady = sum(timed_step() for _ in range(steps)) / steps
    from torch._dynamo.utils import compile_times, counters

    return dict(mode=mode, ttt=ttt, seq=seq, import_s=round(imported, 2), build_s=round(built, 2),
                first_step_s=round(first, 2), steps_2_5_s=[round(x, 3) for x in early],
                steady_ms=round(steady * 1000, 2), to_first_step_s=round(time.time() - T0 - steady * steps
                                                                          - sum(early), 2),
                graphs=dict(counters["stats"]), recompiles=sum(counters["recompiles"].values()) or None,
                compile_times=compile_times(repr="str", aggregate=True)[:2000])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="eager,cold,warm,dynamic-cold,dynamic-warm")
    p.add_argument("--ttt", type=int, nargs="+", default=[3, 5])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seq, args.ttt[0], args.steps)), flush=True)
        return 0
    caches = {kind: tempfile.mkdtemp(prefix=f"inductor-{kind or 'static'}-") for kind in ("", "dynamic", "unmarked")}
    for mode in args.modes.split(","):
        for ttt in args.ttt:
            cache = caches[next((k for k in caches if k and mode.startswith(k)), "")]
            env = dict(os.environ, LONGRUN_COMPILE="0" if mode == "eager" else "1", TORCHINDUCTOR_CACHE_DIR=cache,
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--ttt", str(ttt), "--seq",
                                  str(args.seq), "--steps", str(args.steps)], env=env, capture_output=True, text=True)
            line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else json.dumps(
                dict(mode=mode, ttt=ttt, failed=out.returncode, stderr=out.stderr[-1500:]))
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
