"""Training-step throughput of longrun's EAGLE-3 trainer on one GPU, shaped like bench_speculators.py.

    python benchmarks/bench_trainer.py 2048x3 4096x16        # Llama-3.1-8B-shaped draft, one GPU
    python benchmarks/bench_trainer.py --tiny 64x3            # a tiny draft; runs on the CPU too
    python benchmarks/bench_trainer.py --documents 8 2048x3    # each sequence packs 8 samples (--pack-samples)

Draft: hidden 4096, intermediate 14336, 32 heads / 8 KV heads, verifier vocab 128256, draft vocab
32000. Synthetic verifier features on the device, bf16 autocast over fp32 weights, AdamW, clip 0.5.
Each step is the trainer's own `TrainingStep`: verifier targets (final norm + the lm_head's draft-vocabulary
rows, with the top-1 ids stored as `prepare` stores them; `--no-stored-top`: the full head), T TTT steps,
backward, clip, optimizer and scheduler. One JSON line per SEQxTTT:

- ms_per_step, tokens_per_s (sequence tokens per second), peak_gib;
- gflop_per_token_step: matrix FLOPs of one TTT step per token, forward and backward (3x forward):
  the hidden half of q/k/v, o_proj, the MLP, the draft lm_head, and causal attention over S keys;
- tflops: all matrix FLOPs of the step (TTT steps + fc + token half of q/k/v + verifier lm_head) / time;
- tflops_marginal: the FLOPs of the extra T-1 TTT steps over the extra time against the same
  sequence at T=1 (what one more TTT step costs), and mfu_marginal: that over the measured bf16
  matmul rate of this GPU (matmul_tflops) — the score docs/trainer.md describes;
- ttt_iter_ms, step_fixed_ms: the trainer's own split of a compiled step (trainer/step_timing.py, what its metric
  lines carry and the restart dry run prices a deeper TTT from), over 3 more steps (T >= 2);
- predicted_ms_per_step, prediction_error: for each later SEQxTTT, the step time that split of the first cell at
  that sequence length predicts (fixed + T x iteration) and predicted / measured - 1. The dry run's target: within
  5 % at TTT=5 and 10 from a TTT=3 cell at the Kimi-K2 draft shape:

    python benchmarks/bench_trainer.py --shape kimi-k2 2048x3 2048x5 2048x10
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.model import DraftConfig, EagleDraft  # noqa: E402
from trainer.optim import build_optimizer, build_scheduler  # noqa: E402
from trainer.step import TrainingStep  # noqa: E402
from trainer.step_timing import ChainTimer, figures  # noqa: E402
from trainer.ttt import TTTObjective, plan_trained_rows  # noqa: E402
from trainer.verifier_model import VerifierHead  # noqa: E402

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, draft_vocab_size=32000, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)
# a DeepSeek-V3 / Kimi-K2 verifier's width and vocabulary, 61 layers; the draft attention SpecForge uses for it
KIMI_K2 = dict(
    hidden_size=7168, intermediate_size=18432, num_attention_heads=56, num_key_value_heads=8, head_dim=128,
    vocab_size=163840, draft_vocab_size=32000, rope_theta=50000.0, rope_scaling=None, num_hidden_layers=61,
)
TINY = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=512, draft_vocab_size=128, rope_theta=10000.0, rope_scaling=None,
)


def random_vocab_mapping(vocab: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted target ids of a random draft vocabulary, t2d mask over the target vocabulary)."""
    draft_ids = torch.randperm(vocab)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids, t2d


def make_config(shape: dict, ttt_steps: int) -> DraftConfig:
    return DraftConfig(
        **{k: v for k, v in shape.items() if k != "num_hidden_layers"}, rms_norm_eps=1e-5, target_hidden_size=shape["hidden_size"], aux_hidden_state_layer_ids=[2, 16, 29],
        max_position_embeddings=131072, ttt_steps=ttt_steps,
    )


def flops(cfg: DraftConfig, seq: int, ttt: int, full_head: bool = False) -> tuple[float, float]:
    """(matrix FLOPs of one TTT step per token, fwd+bwd; all matrix FLOPs of one training step)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    per_step_params = h * qkv + cfg.num_attention_heads * d * h + 3 * h * cfg.intermediate_size + h * cfg.draft_vocab_size
    attention = 2 * cfg.num_attention_heads * d * (seq + 1)  # QK and PV over (S+1)/2 keys on average, x2 FLOPs
    per_token_step = 3 * (2 * per_step_params + attention)
    head_rows = cfg.vocab_size if full_head else cfg.draft_vocab_size
    once = 3 * 2 * (3 * h * h + h * qkv) + 2 * h * head_rows  # fc, token half of q/k/v; verifier head fwd only
    return per_token_step, seq * (ttt * per_token_step + once)


def matmul_tflops(device: torch.device) -> float:
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    seconds = timed(lambda: a @ b, device, 20)
    return 2 * n**3 / seconds / 1e12


def timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def random_draft(shape: dict, ttt: int, device: torch.device) -> tuple[EagleDraft, VerifierHead, torch.Tensor]:
    """(a draft of `shape` with random weights and vocabulary, its verifier head, target_to_draft on the CPU)."""
    torch.manual_seed(0)
    cfg = make_config(shape, ttt)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    v, h, k = cfg.vocab_size, cfg.hidden_size, cfg.draft_vocab_size
    draft_ids, t2d = random_vocab_mapping(v, k)
    target_to_draft = torch.full((v,), -1, dtype=torch.long)
    target_to_draft[draft_ids] = torch.arange(k)
    # build on the device: initialising ~0.7B parameters on the CPU took longer than measuring them
    with torch.device(device):
        head = VerifierHead(torch.ones(h), 1e-5, torch.randn(v, h) * 0.02, draft_ids.to(device),
                            target_to_draft.to(device)).to(device, dtype)
        draft = EagleDraft(cfg, (torch.randn(v, h) * 0.02).to(dtype))
    draft.set_vocab_mapping((draft_ids - torch.arange(k)).to(device), t2d.to(device))
    return draft.to(device), head, target_to_draft


def bench(shape: dict, seq: int, ttt: int, device: torch.device, steps: int, warmup: int, documents: int = 1,
          stored_top: bool = True, profile: bool | str = False, plan_rows: bool = True) -> dict:
    draft, head, target_to_draft = random_draft(shape, ttt, device)
    cfg = draft.config
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    v, h = cfg.vocab_size, cfg.hidden_size
    objective = TTTObjective(draft, ttt, 0.8)
    optimizer = build_optimizer(draft.parameters(), 1e-4)
    scheduler = build_scheduler(optimizer, "constant", 10**6, 0.0)
    batch = {
        "hidden_states": torch.randn(1, seq, 3 * h, device=device, dtype=dtype),
        "last_hidden_state": torch.randn(1, seq, h, device=device, dtype=dtype),
        "input_ids": torch.randint(0, v, (1, seq), device=device),
        "loss_mask": torch.ones(1, seq, dtype=torch.uint8, device=device),
        "attention_mask": torch.ones(1, seq, dtype=torch.long, device=device),
    }
    if stored_top:  # as `prepare` stores them: the verifier's top-1, computed once, outside the timed steps
        batch["verifier_top_ids"] = head.logits(batch["last_hidden_state"][0]).argmax(-1).int()[None]
    if documents > 1:  # a packed row: `documents` samples of equal length (the last takes the remainder)
        lengths = [seq // documents] * (documents - 1) + [seq - seq // documents * (documents - 1)]
        batch["documents"] = (tuple(lengths),)
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    if stored_top and plan_rows:  # each step's trained rows, found on the CPU as the training loader does
        planned = plan_trained_rows({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()},
                                    target_to_draft, ttt)
        batch.update(trained_rows=planned["trained_rows"].to(device), trained_counts=planned["trained_counts"])
    noise = torch.Generator(device).manual_seed(0)
    train_step = TrainingStep(objective, objective, head, optimizer, scheduler, 0.05, noise, 0.5)

    def step():
        train_step([batch])

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    warmup_s = time.time() - t0
    seconds = timed(step, device, steps)
    split = []
    for _ in range(3):  # the trainer's split of a step, as its metric lines carry it
        objective.timer = ChainTimer(device.type == "cuda")
        split.append(figures(objective.timer, timed(step, device, 1), ttt))
    objective.timer = None
    timed_split = {f"{key[:-2]}_ms": round(sum(f[key] for f in split) / len(split) * 1000, 3)
                   for key in ("ttt_iter_s", "step_fixed_s") if all(key in f for f in split)}
    if profile:  # where the device time of three more steps goes, by op, and whether the GPU waits for the host
        profile_steps(step, f"{seq}x{ttt}", profile if isinstance(profile, str) else None)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    per_token_step, total = flops(cfg, seq, ttt, full_head=not stored_top)
    return dict(
        trainer="longrun", seq=seq, ttt=ttt, **({"documents": documents} if documents > 1 else {}), ms_per_step=round(seconds * 1000, 2), tokens_per_s=round(seq / seconds),
        peak_gib=round(peak, 2), warmup_s=round(warmup_s, 1), gflop_per_token_step=round(per_token_step / 1e9, 3),
        tflops=round(total / seconds / 1e12, 3), seconds=seconds, per_token_step=per_token_step, **timed_split,
    )


def profile_steps(step, cell: str, directory: str | None) -> None:
    """Three steps under torch.profiler: wall time per step, the share in which the device was busy, and the
    host's own time (until a step's call returns, then the device's tail after it: a tail near zero means
    the device waited for launches); the ops that took the most device time to stderr, and with `directory`
    the Chrome trace and the per-kernel totals (JSON) of the cell there."""
    import gzip
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity

    from trainer.profiling import device_busy_seconds

    host, tail = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append(t1 - t0)
        tail.append(time.perf_counter() - t1)
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 3
    out = Path(directory) if directory else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        busy = device_busy_seconds(json.loads(trace_path.read_text())) / 3
        if out:  # the timeline itself, for Perfetto or chrome://tracing
            with trace_path.open("rb") as src, gzip.open(out / f"trace_{cell}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
    ops = prof.key_averages()
    kernels = {e.key: [e.count / 3, e.self_device_time_total / 3 / 1000]  # per step: calls, ms
               for e in ops if e.self_device_time_total > 0}
    summary = dict(cell=cell, wall_ms=round(wall * 1000, 2), device_busy_ms=round(busy * 1000, 2),
                   busy_share=round(busy / wall, 3), host_ms=round(sum(host) / 3 * 1000, 2),
                   device_tail_ms=round(sum(tail) / 3 * 1000, 2))
    print("# profile " + json.dumps(summary), file=sys.stderr, flush=True)
    print(ops.table(sort_by="self_cuda_time_total", row_limit=30), file=sys.stderr, flush=True)
    if out:
        (out / f"kernels_{cell}.json").write_text(json.dumps(dict(summary=summary, kernels=kernels), indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("configs", nargs="*", help="SEQxTTT, e.g. 2048x3 (default: the peer script's list)")
    p.add_argument("--tiny", action="store_true", help="a tiny draft (CPU smoke test)")
    p.add_argument("--shape", choices=("llama-8b", "kimi-k2"), default="llama-8b",
                   help="the verifier's and draft's shape (bench_from_disk.py's --shape)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--documents", type=int, default=1, help="samples packed in each sequence (1: not packed)")
    p.add_argument("--no-stored-top", action="store_true",
                   help="batches without the verifier's top-1 ids (other tools' data): the full verifier head each step")
    p.add_argument("--device-rows", action="store_true",
                   help="find each step's trained rows on the device (two reads that wait for the GPU) instead of "
                        "taking them planned on the CPU, as the training loader does")
    p.add_argument("--profile", action="store_true", help="print the ops that take the most device time (stderr)")
    p.add_argument("--profile-dir", help="with --profile: write each cell's Chrome trace and kernel totals here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        p.error("no GPU here: pass --tiny for a CPU smoke test")
    shape = TINY if args.tiny else {"llama-8b": LLAMA_8B, "kimi-k2": KIMI_K2}[args.shape]
    configs = [tuple(map(int, c.split("x"))) for c in args.configs] or (
        [(2048, t) for t in (1, 3, 5, 7, 10, 16)] + [(4096, t) for t in (3, 5, 10)]
    )
    rate = matmul_tflops(device)
    one_step_seconds: dict[int, float] = {}  # per sequence length, at T=1
    split_of: dict[int, tuple[float, float]] = {}  # per sequence length: the first timed cell's (fixed, iteration) ms
    for seq, ttt in configs:
        try:
            result = bench(shape, seq, ttt, device, args.steps, args.warmup, args.documents, not args.no_stored_top,
                           (args.profile_dir or True) if args.profile and device.type == "cuda" else False,
                           not args.device_rows)
            if ttt == 1:
                one_step_seconds.setdefault(seq, result["seconds"])
            elif seq not in one_step_seconds:
                one_step_seconds[seq] = bench(shape, seq, 1, device, args.steps, args.warmup, args.documents,
                                              not args.no_stored_top, plan_rows=not args.device_rows)["seconds"]
            extra = result["seconds"] - one_step_seconds[seq] if ttt > 1 else None
            marginal = (ttt - 1) * seq * result["per_token_step"] / extra / 1e12 if extra and extra > 0 else None
            result.update(
                tflops_marginal=round(marginal, 3) if marginal else None, matmul_tflops=round(rate, 3),
                mfu_marginal=round(marginal / rate, 3) if marginal else None,
            )
            if seq in split_of:
                fixed, iteration = split_of[seq]
                predicted = fixed + ttt * iteration
                result.update(predicted_ms_per_step=round(predicted, 2),
                              prediction_error=round(predicted / result["ms_per_step"] - 1, 4))
            elif "ttt_iter_ms" in result:
                split_of[seq] = (result["step_fixed_ms"], result["ttt_iter_ms"])
            for key in ("seconds", "per_token_step"):
                result.pop(key)
            print(json.dumps(result), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except torch.OutOfMemoryError as e:  # an OOM at one depth is itself a finding
            print(json.dumps(dict(trainer="longrun", seq=seq, ttt=ttt, error=f"OutOfMemoryError: {str(e)[:200]}")), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
