"""What the simulated acceptance (`--sim-depth`, trainer/simulate.py) costs against a training step, on one device.

    python benchmarks/bench_sim.py 4096x5                  # Llama-3.1-8B-shaped draft, one GPU
    python benchmarks/bench_sim.py --tiny 64x3             # a tiny draft; runs on the CPU too

For each SEQxTTT: the training step (bench_trainer.py's, the production path), and the trainer's own `Validator`
over --rows validation rows of SEQ tokens, with the simulation off and at --depth for each acceptance rate p of
--accept. The draft's hidden path is zeroed (fc, o_proj), so it proposes draft id 0 everywhere, and the stored
verifier top-1 is draft id 0 at a random share p of the positions: each proposal is accepted with probability p
and a round lives k steps with probability p^k, as a draft with conditional acceptance p would. The work is the
same dense matrices as a trained draft's (zeros do not make a matrix product cheaper). p = 1 keeps every chain
alive to the depth: the most the simulation can cost.

One JSON line per cell: ms_per_step (training), ms_val_row (validation with the simulation off, per row), and per
p: ms_sim_row (what the simulation adds per validation row), sim_row_over_step (R = that / ms_per_step), and
overhead_uncapped (R x val_ratio / (1 - val_ratio): every validation row simulated, one validation per epoch,
amortised over the epoch's training steps; batch size and ranks cancel). With the --sim-samples cap C the
overhead is R x min(val_ratio / (1 - val_ratio), C / training rows per epoch): `rows_for_5pct_with_cap` is the
training set above which the cap alone holds it under 5 %.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_trainer import LLAMA_8B, TINY, bench, random_draft  # noqa: E402
from trainer.ttt import TTTObjective  # noqa: E402
from trainer.validation import Validator  # noqa: E402


def validation_seconds(shape: dict, seq: int, ttt: int, device: torch.device, rows: int, depth: int, accept: float,
                       repeats: int) -> float:
    """Seconds per row of one validation pass over `rows` rows (depth 0: the simulation off)."""
    draft, head, _ = random_draft(shape, ttt, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    v, h = draft.config.vocab_size, draft.config.hidden_size
    draft_ids = head.draft_ids.cpu()
    with torch.no_grad():  # the hidden state stays zero: the draft proposes draft id 0 at every position and step
        draft.fc.weight.zero_()
        draft.midlayer.self_attn.o_proj.weight.zero_()
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(rows):
        agree = torch.rand(1, seq, generator=generator) < accept
        top = torch.where(agree, draft_ids[0], draft_ids[1]).int()
        batches.append({
            "hidden_states": torch.randn(1, seq, 3 * h, generator=generator).to(device, dtype),
            "last_hidden_state": torch.randn(1, seq, h, generator=generator).to(device, dtype),
            "input_ids": torch.randint(0, v, (1, seq), generator=generator).to(device),
            "loss_mask": torch.ones(1, seq, dtype=torch.uint8, device=device),
            "verifier_top_ids": top.to(device),
        })
    validator = Validator(TTTObjective(draft, ttt), head, batches, lambda t: t, device, dtype, depth, None)
    result = validator()  # warm-up (allocator, kernels)
    if depth:  # the draft is accepted at the rate planted
        assert abs(result["sim_acc_1"] - accept) < 0.05, (result["sim_acc_1"], accept)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        validator()  # ends with a read of its totals on the host: the work is done
    return (time.perf_counter() - t0) / repeats / rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="*", default=["4096x5"], help="SEQxTTT (default 4096x5)")
    p.add_argument("--tiny", action="store_true", help="a tiny draft (CPU smoke test)")
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--accept", type=float, nargs="+", default=[1.0, 0.8], help="conditional acceptance rates")
    p.add_argument("--rows", type=int, default=8, help="validation rows per pass")
    p.add_argument("--repeats", type=int, default=3, help="timed validation passes")
    p.add_argument("--steps", type=int, default=12, help="timed training steps")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--val-ratio", type=float, default=0.05)
    p.add_argument("--sim-samples", type=int, default=256, help="the trainer's cap (its default)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        p.error("no GPU here: pass --tiny for a CPU smoke test")
    shape = TINY if args.tiny else LLAMA_8B
    for seq, ttt in (tuple(map(int, c.split("x"))) for c in args.configs):
        step = bench(shape, seq, ttt, device, args.steps, args.warmup)["seconds"]
        off = validation_seconds(shape, seq, ttt, device, args.rows, 0, 1.0, args.repeats)
        result = dict(seq=seq, ttt=ttt, depth=args.depth, device=torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", ms_per_step=round(step * 1000, 3), ms_val_row=round(off * 1000, 3), by_accept=[])
        for accept in args.accept:
            on = validation_seconds(shape, seq, ttt, device, args.rows, args.depth, accept, args.repeats)
            ratio = max(on - off, 0.0) / step
            result["by_accept"].append(dict(
                accept=accept, ms_val_row_sim=round(on * 1000, 3), ms_sim_row=round((on - off) * 1000, 3),
                sim_row_over_step=round(ratio, 4),
                overhead_uncapped=round(ratio * args.val_ratio / (1 - args.val_ratio), 4),
                rows_for_5pct_with_cap=round(ratio * args.sim_samples / 0.05),
            ))
        print(json.dumps(result), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
