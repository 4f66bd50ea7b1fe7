"""Train an EAGLE-3 draft with test-time-training steps.

    torchrun --nproc_per_node=N -m trainer.train --verifier-path V --data-dir D/hidden_states \
        --vocab-mapping-dir D/vocab_mapping --output-dir O --epochs 5 --lr 3e-5 --max-seq-len 4096 \
        --num-workers 4 --ttt-steps 5 --noise-std 0.05 --scheduler cosine --warmup-ratio 0.01 --val-ratio 0.05

Plain `python -m trainer.train ...` is one process. A relaunch into an output dir that has
checkpoints resumes from the latest complete one; SIGTERM stops after the current step with exit
code 143.
"""

import argparse
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.data import make_loader, split_files
from trainer.formats import DATA_FORMATS, open_training_data
from trainer.metrics import MetricsReporter, metrics_path
from trainer.model import DraftConfig, EagleDraft, load_draft_weights
from trainer.optim import SCHEDULERS, build_optimizer, build_scheduler
from trainer.profiling import StepProfiler
from trainer.ttt import STAT_FIELDS, TTTObjective, add_feature_noise, summarize_stats, verifier_targets
from trainer.verifier_io import VerifierHead, load_verifier_head, read_verifier_config
from trainer.vocab import load_vocab_mapping

EXIT_TERMINATED = 128 + signal.SIGTERM


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier-path", required=True, help="Hugging Face directory of the verifier (config + safetensors)")
    p.add_argument("--data-dir", required=True, help="per-sample files: trainer.prepare's, speculators' or SpecForge's")
    p.add_argument("--data-format", choices=("auto", *DATA_FORMATS), default="auto", help="layout of --data-dir")
    p.add_argument("--vocab-mapping-dir", required=True,
                   help="vocab_mapping.safetensors, speculators' d2t.npy + t2d.npy or SpecForge's vocab_mapping.pt")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--num-workers", type=int, default=2, help="threads per rank that read batches ahead (0: read in line)")
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--ttt-step-decay", type=float, default=0.8, help="loss weight w^k of TTT step k")
    p.add_argument("--noise-std", type=float, default=0.05, help="uniform noise in [-s, s] on the captured features")
    p.add_argument("--scheduler", choices=SCHEDULERS, default="cosine")
    p.add_argument("--warmup-ratio", type=float, default=0.01)
    p.add_argument("--val-ratio", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=1, help="samples per rank per optimizer step")
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps too (0: epoch ends only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--no-resume", action="store_true", help="refuse to start when the output dir has checkpoints")
    p.add_argument("--init-from", default=None, help="draft weights to start from (a checkpoint or output dir)")
    p.add_argument("--eval-corpus", default=None,
                   help="held-out text: at the end, measure acceptance by depth (trainer.evaluate) and report it")
    p.add_argument("--eval-max-depth", type=int, default=8)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--eval-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.ttt_steps < 1 or args.epochs < 1 or args.batch_size < 1 or args.max_seq_len < 2:
        p.error("--ttt-steps, --epochs and --batch-size must be at least 1, --max-seq-len at least 2")
    return args


@dataclass
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @classmethod
    def from_environment(cls) -> "Distributed":
        """Under torchrun: one process per GPU (NCCL), or gloo on CPU; otherwise a single process."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
        else:
            device = torch.device("cpu")
        if world_size > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(rank, world_size, local_rank, device)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def from_rank0(self, value):
        """Rank 0's `value` on every rank (so that all ranks act on one reading of the disk)."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class StopRequest:
    """SIGTERM asks the loop to stop after the current step, on every rank at the same step.

    A cancel's SIGTERM reaches a rank twice within milliseconds (from the supervisor, and forwarded by
    torchrun): repeats within `repeat_window` seconds count as one. Leaving mid-step would strand the
    other ranks in a collective (with NCCL, until its timeout). A SIGTERM after that window leaves at once."""

    def __init__(self, repeat_window: float = 5.0):
        self.requested = False
        self.requested_at = 0.0
        self.repeat_window = repeat_window
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.requested:
            self.requested, self.requested_at = True, now
        elif now - self.requested_at > self.repeat_window:
            raise SystemExit(128 + signum)


def init_weights_path(path: str) -> Path:
    """A directory with model.safetensors (a checkpoint or an exported draft), or an output dir's latest checkpoint."""
    candidate = Path(path)
    if (candidate / "model.safetensors").is_file():
        return candidate
    latest = latest_checkpoint(candidate)
    if latest is None:
        raise FileNotFoundError(f"--init-from {path}: no model.safetensors and no checkpoints there")
    return latest


def load_weights_with_same_vocab(draft: EagleDraft, path: Path) -> None:
    d2t, t2d = draft.d2t.clone(), draft.t2d.clone()
    load_draft_weights(draft, path)
    if not (torch.equal(d2t, draft.d2t) and torch.equal(t2d, draft.t2d)):
        raise ValueError(f"{path} was trained with a different draft vocabulary than --vocab-mapping-dir")


def build_draft(args: argparse.Namespace, dtype: torch.dtype, init_from: str | None) -> tuple[EagleDraft, VerifierHead]:
    """A new draft (or `init_from`'s weights) shaped after the verifier, and the head that computes targets."""
    d2t, t2d = load_vocab_mapping(args.vocab_mapping_dir)
    verifier = read_verifier_config(args.verifier_path)
    config = DraftConfig.from_verifier(verifier, d2t.numel(), args.ttt_steps)
    data = open_training_data(args.data_dir, args.data_format, verifier["num_hidden_layers"])
    config.aux_hidden_state_layer_ids = data.layer_ids
    head, embed_weight = load_verifier_head(args.verifier_path, d2t, t2d)
    head.input_is_normed = data.last_hidden_state_normed
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    draft = EagleDraft(config, embed_weight.to(dtype))
    draft.set_vocab_mapping(d2t, t2d)
    if init_from:
        path = init_weights_path(init_from)
        load_weights_with_same_vocab(draft, path)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"initialised the draft from {path}", flush=True)
    return draft, head


class Throughput:
    """Tokens per second over the last `window` steps. A single step's interval is noisy: its metrics are
    read when the next step is queued, which a slow batch can delay."""

    def __init__(self, window: int = 10, clock=time.time):
        self.clock = clock
        self.marks: deque[tuple[float, float]] = deque(maxlen=window + 1)
        self.reset()

    def reset(self) -> None:
        """Start over (after a pause that is not training: validation, a checkpoint)."""
        self.marks.clear()
        self.marks.append((self.clock(), 0.0))

    def add(self, tokens: float) -> float:
        now = self.clock()
        self.marks.append((now, tokens))
        return sum(t for _, t in list(self.marks)[1:]) / max(now - self.marks[0][0], 1e-9)


@dataclass
class StepMetrics:
    """A finished step's metrics, all-reduced on the device and not read yet."""

    step: int
    epoch: float
    lr: float
    values: torch.Tensor  # [loss, grad norm, tokens, stop flag, *stats] summed over ranks, on the host
    stats_shape: torch.Size
    ready: torch.cuda.Event | None  # recorded after the copy to the host (GPU only)


def reduce_step_metrics(
    ctx: Distributed, step: int, epoch: float, lr: float, loss: torch.Tensor, stats: torch.Tensor,
    grad_norm: torch.Tensor, tokens: torch.Tensor, stop_requested: bool,
) -> StepMetrics:
    """One all-reduce for a step's metrics and whether any rank was asked to stop; queued, not waited for."""
    flag = torch.ones(1, device=loss.device) * float(stop_requested)
    packed = ctx.sum(torch.cat([loss.float()[None], grad_norm.float()[None], tokens.float()[None], flag, stats.flatten()]))
    if not packed.is_cuda:
        return StepMetrics(step, epoch, lr, packed, stats.shape, None)
    # copied now, in stream order, so that reading it waits for this step only, not for the next one queued
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return StepMetrics(step, epoch, lr, host, stats.shape, ready)


def read_step_metrics(ctx: Distributed, pending: StepMetrics) -> tuple[dict, float, bool]:
    """(per-step metrics averaged over ranks, tokens on all ranks, whether any rank was asked to stop)."""
    if pending.ready is not None:
        pending.ready.synchronize()
    values = pending.values
    stats_sum = values[4:].view(pending.stats_shape).clone()
    stats_sum[:, 0] /= ctx.world_size
    metrics = {"loss": values[0].item() / ctx.world_size, **summarize_stats(stats_sum), "grad_norm": values[1].item() / ctx.world_size}
    return metrics, values[2].item(), values[3].item() > 0


def batch_to(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    for name in ("hidden_states", "last_hidden_state"):
        out[name] = out[name].to(dtype)
    return out


def prefetch_to_device(loader: Iterable[dict], device: torch.device, dtype: torch.dtype) -> Iterator[dict]:
    """The loader's batches on `device`; on a GPU, batch i+1 is copied on a side stream while step i runs.

    A 4096-token sample of an 8B verifier carries ~130 MB of features: copied in line, that is milliseconds
    of idle GPU every step."""
    if device.type != "cuda":
        for batch in loader:
            yield batch_to(batch, device, dtype)
        return
    copies = torch.cuda.Stream(device)

    def issue(batch: dict | None) -> dict | None:
        if batch is None:
            return None
        with torch.cuda.stream(copies):
            return batch_to(batch, device, dtype)

    batches = iter(loader)
    pending = issue(next(batches, None))
    while pending is not None:
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(copies)
        for tensor in pending.values():
            tensor.record_stream(compute)
        batch, pending = pending, issue(next(batches, None))
        yield batch


def train_step(model, head: VerifierHead, batch: dict, optimizer, scheduler, params, noise, args) -> tuple[torch.Tensor, ...]:
    """One optimizer step; returns (loss, per-step stats, grad norm), all still on the device."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch["input_ids"].is_cuda):
        targets = verifier_targets(head, batch["last_hidden_state"], batch["loss_mask"])
        hidden_states = add_feature_noise(batch["hidden_states"], args.noise_std, noise)
        loss, stats = model(hidden_states, batch["input_ids"], targets)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), stats, grad_norm


@torch.no_grad()
def validate(objective: TTTObjective, head: VerifierHead, loader, ctx: Distributed, dtype: torch.dtype) -> dict | None:
    """val_loss (weighted like training, mean over batches), val_loss_k, val_acc_k, val_cond_acc_k."""
    steps = objective.ttt_steps
    totals = torch.zeros(steps * len(STAT_FIELDS) + 2, device=ctx.device)
    for batch in loader:
        batch = batch_to(batch, ctx.device, dtype)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ctx.device.type == "cuda"):
            targets = verifier_targets(head, batch["last_hidden_state"], batch["loss_mask"])
            loss, stats = objective(batch["hidden_states"], batch["input_ids"], targets)
        totals += torch.cat([loss.float()[None], stats.flatten(), totals.new_ones(1)])
    totals = ctx.sum(totals).cpu()
    batches = totals[-1].item()
    if batches == 0:
        return None
    stats = totals[1:-1].view(steps, len(STAT_FIELDS))
    stats[:, 0] /= batches
    metrics = summarize_stats(stats, prefix="val_")
    return {"val_loss": totals[0].item() / batches, **metrics}


def report_acceptance(args: argparse.Namespace, reporter: MetricsReporter, step: int, total_steps: int,
                      device: torch.device) -> None:
    """Speculative decoding with the exported draft on held-out text; one metrics line carries the report."""
    from trainer.evaluate import evaluate_draft

    report = evaluate_draft(args.verifier_path, args.output_dir, Path(args.eval_corpus), args.eval_max_depth,
                            args.eval_samples, args.eval_new_tokens, device=str(device))
    taus = {f"eval_accepted_{row['depth']}": row["mean_accepted"] for row in report["by_depth"]}
    reporter.write({"step": step, "total_steps": total_steps, **taus, "evaluation": report})
    print("acceptance by depth: " + " ".join(f"{row['depth']}:{row['mean_accepted']:.2f}" for row in report["by_depth"]),
          flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stop = StopRequest()
    ctx = Distributed.from_environment()
    try:
        return run(args, ctx, stop)
    except Exception:
        if stop.requested:  # e.g. a collective broken by a rank that stopped
            return EXIT_TERMINATED
        raise
    finally:
        ctx.close()


def run(args: argparse.Namespace, ctx: Distributed, stop: StopRequest) -> int:
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    resume_from = ctx.from_rank0(latest_checkpoint(output_dir))
    if resume_from is not None and args.no_resume:
        raise SystemExit(
            f"{output_dir} already has checkpoints (latest {resume_from.name}) and --no-resume was given: "
            "choose an empty --output-dir, or drop --no-resume to continue that run"
        )
    cuda = ctx.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    log = print if ctx.rank == 0 else (lambda *a, **k: None)

    draft, head = build_draft(args, dtype, init_from=args.init_from if resume_from is None else None)
    config = draft.config
    draft.to(ctx.device)
    head = head.to(ctx.device, dtype)
    objective = TTTObjective(draft, args.ttt_steps, args.ttt_step_decay)
    model = objective
    if ctx.world_size > 1:
        model = DistributedDataParallel(
            objective, device_ids=[ctx.local_rank] if cuda else None, broadcast_buffers=False
        )
    params = [p for p in draft.parameters() if p.requires_grad]

    data = open_training_data(args.data_dir, args.data_format, read_verifier_config(args.verifier_path)["num_hidden_layers"])
    train_files, val_files = split_files(data.files, args.val_ratio, args.seed)
    if not train_files:
        raise SystemExit(f"no training samples in {args.data_dir}; run `python -m trainer.prepare` first")
    train_set = data.dataset(train_files, args.max_seq_len)
    width = train_set[0]["hidden_states"].shape[-1]
    if width != 3 * config.target_hidden_size:
        raise SystemExit(
            f"{args.data_dir} holds features {width} wide but the verifier needs 3 x {config.target_hidden_size}: "
            "was the data prepared with this --verifier-path?"
        )
    loader = make_loader(train_set, args.batch_size, args.num_workers, True, args.seed, ctx.rank, ctx.world_size)
    steps_per_epoch = len(loader.batch_sampler)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    val_loader = None
    if val_files:
        val_set = data.dataset(val_files, args.max_seq_len)
        val_loader = make_loader(val_set, args.batch_size, 0, False, args.seed, ctx.rank, ctx.world_size)

    optimizer = build_optimizer(params, args.lr)
    scheduler = build_scheduler(optimizer, args.scheduler, total_steps, args.warmup_ratio)
    step, epoch, start_batch = 0, 0, 0
    # The feature noise has its own generator: data loaders draw from the global one as they start.
    noise = torch.Generator(ctx.device).manual_seed(args.seed + 1000 * (ctx.rank + 1))
    if resume_from is not None:
        state, rank_state = load_checkpoint(resume_from, draft, optimizer, scheduler, ctx.rank)
        if "noise" in rank_state:
            noise.set_state(rank_state["noise"])
        step, epoch, start_batch = state["step"], state["epoch"], state["batch"]
        if state.get("world_size", ctx.world_size) != ctx.world_size:  # keep the samples seen, roughly
            start_batch = start_batch * state["world_size"] // ctx.world_size
        if state.get("ttt_steps") != args.ttt_steps:
            log(f"note: {resume_from.name} was trained with {state.get('ttt_steps')} TTT steps, continuing with {args.ttt_steps}")
        log(f"resuming from {resume_from} at step {step} (epoch {epoch}, batch {start_batch})")

    n_params = sum(p.numel() for p in params)
    log(
        f"draft: {n_params / 1e6:.1f}M trainable parameters, hidden {config.hidden_size}, draft vocab "
        f"{config.draft_vocab_size}/{config.vocab_size}, TTT steps {args.ttt_steps}; {len(train_files)} train / "
        f"{len(val_files)} val samples, {ctx.world_size} rank(s) on {ctx.device.type}, {total_steps} steps",
        flush=True,
    )
    reporter = MetricsReporter(metrics_path(output_dir), enabled=ctx.rank == 0)

    def checkpoint(position: tuple[int, int]) -> None:
        state = {
            "epoch": position[0], "batch": position[1], "total_steps": total_steps, "world_size": ctx.world_size,
            "ttt_steps": args.ttt_steps, "args": vars(args),
        }
        save_checkpoint(
            output_dir, step, draft, optimizer, scheduler, state, {"noise": noise.get_state()}, ctx.rank, ctx.barrier
        )

    profiler = StepProfiler(ctx.rank)
    try:
        throughput = Throughput()
        # A step's metrics are read once the next step is queued: reading them at once would make the CPU
        # wait for the GPU every step, and the GPU then waits for the CPU to queue the next one.
        in_flight: StepMetrics | None = None

        def publish() -> bool:
            """Write the step in flight's metrics line; True when a rank was asked to stop."""
            nonlocal in_flight
            if in_flight is None:
                return False
            metrics, tokens, stopping = read_step_metrics(ctx, in_flight)
            reporter.train_step({
                "step": in_flight.step,
                "total_steps": total_steps,
                "epoch": in_flight.epoch,
                **metrics,
                "lr": in_flight.lr,
                "tokens_per_s": throughput.add(tokens),
                "ttt_steps": args.ttt_steps,
            })
            in_flight = None
            return stopping

        def stopped() -> int:
            publish()  # the step after the one that saw the request ran too
            log(f"stopping at step {step} on SIGTERM", flush=True)
            return EXIT_TERMINATED

        while step < total_steps and epoch < args.epochs:
            loader.batch_sampler.set_epoch(epoch, start_batch)
            batch_index = start_batch
            for batch in prefetch_to_device(loader, ctx.device, dtype):
                lr = scheduler.get_last_lr()[0]
                loss, stats, grad_norm = train_step(model, head, batch, optimizer, scheduler, params, noise, args)
                step += 1
                batch_index += 1
                previous_stops = publish()
                profiler.step()
                in_flight = reduce_step_metrics(
                    ctx, step, epoch + batch_index / steps_per_epoch, lr, loss, stats, grad_norm,
                    batch["attention_mask"].sum(), stop.requested,
                )
                if previous_stops:
                    return stopped()
                if step >= total_steps:
                    break
                if args.save_every and step % args.save_every == 0:
                    if publish():  # a checkpoint never runs ahead of the metrics on disk
                        return stopped()
                    checkpoint((epoch, batch_index))
            if publish():
                return stopped()
            epoch_done = batch_index >= steps_per_epoch
            position = (epoch + 1, 0) if epoch_done else (epoch, batch_index)
            if val_loader is not None:
                metrics = validate(objective, head, val_loader, ctx, dtype)
                if metrics is not None:
                    reporter.validation({"step": step, "total_steps": total_steps, "epoch": epoch + batch_index / steps_per_epoch, **metrics})
            checkpoint(position)
            epoch, start_batch = position
            throughput.reset()
        log(f"done: {step} steps; draft exported to {output_dir}", flush=True)
        if args.eval_corpus and ctx.rank == 0:
            report_acceptance(args, reporter, step, total_steps, ctx.device)
        return 0
    finally:
        profiler.close()
        reporter.close()


if __name__ == "__main__":
    sys.exit(main())
