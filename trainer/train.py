"""Train an EAGLE-3 draft with test-time-training steps.

    torchrun --nproc_per_node=N -m trainer.train --verifier-path V --data-dir D/hidden_states \
        --vocab-mapping-dir D/vocab_mapping --output-dir O --epochs 5 --lr 3e-5 --max-seq-len 4096 \
        --num-workers 4 --ttt-steps 5 --noise-std 0.05 --scheduler cosine --warmup-ratio 0.01 --val-ratio 0.05

Plain `python -m trainer.train ...` is one process. A relaunch into an output dir that has
checkpoints resumes from the latest complete one; SIGTERM stops after the current step with exit
code 143.
"""

import argparse
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from trainer import compiled, series
from trainer.checkpoint import EXPORT_FORMATS, Checkpointer, Position, latest_checkpoint
from trainer.compiled import BackgroundCompile, share_dynamic_profile
from trainer.config import DataConfig, ModelConfig, TrainConfig, ValidationConfig, default
from trainer.data import BatchLoader, ReaderSizing, make_loader, prefetch_to_device, split_files
from trainer.formats import DATA_FORMATS, open_training_data, parse_layer_ids
from trainer.formats import TrainingData as StoredData
from trainer.metrics import MetricsReporter, StepStart, TrainingMetrics, metrics_path
from trainer.model import DraftConfig, EagleDraft, load_draft_weights
from trainer.optim import SCHEDULERS, build_optimizer, build_scheduler
from trainer.profiling import StartupClock, StepProfiler
from trainer.step import TrainingStep, rehearsal
from trainer.step_timing import ChainTimer
from trainer.trackers import TRACKERS, open_trackers, parse_report_to
from trainer.ttt import TTTObjective, plan_trained_rows
from trainer.validation import Validator
from trainer.verifier_model import VerifierHead, load_verifier_head, read_verifier_config
from trainer.vocab import load_vocab_mapping

EXIT_TERMINATED = 128 + signal.SIGTERM
# the step the background compile starts at (0-based: after this many steps), on a GPU; see run()
COMPILE_FROM_STEP = 2
# the start-up clock of this process's first run, from the process's start: python's own, then these imports
_STARTUP: StartupClock | None = StartupClock()
_STARTUP.mark("python and imports")


def startup_clock() -> StartupClock:
    """The process's start-up clock for its first run; a later run in the same process (tests) times from now."""
    global _STARTUP
    clock, _STARTUP = _STARTUP, None
    return clock or StartupClock(since_process_start=False)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per field of TrainConfig (trainer/config.py), whose defaults it takes."""
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier-path", required=True, help="Hugging Face directory of the verifier (config + safetensors)")
    p.add_argument("--data-dir", required=True, help="per-sample files: trainer.prepare's, speculators' or SpecForge's")
    p.add_argument("--data-format", choices=("auto", *DATA_FORMATS), default=default("data_format"), help="layout of --data-dir")
    p.add_argument("--layer-ids", type=parse_layer_ids, nargs="+", default=default("layer_ids"),
                   help="the verifier layers whose inputs the stored features are, e.g. 2,16,29 (speculators >= 0.5 "
                        "data records none: the ids given to vLLM, no +1); speculators' 4 ids (2 30 58 61: the last "
                        "is the verifier's last layer, the target) are taken too")
    p.add_argument("--vocab-mapping-dir", required=True,
                   help="vocab_mapping.safetensors, speculators' d2t.npy + t2d.npy or SpecForge's vocab_mapping.pt")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--epochs", type=int, default=default("epochs"))
    p.add_argument("--lr", type=float, default=default("lr"))
    p.add_argument("--max-seq-len", type=int, default=default("max_seq_len"))
    p.add_argument("--num-workers", type=int, default=default("num_workers"), help="threads per rank that read batches ahead (0: read in line)")
    p.add_argument("--ttt-steps", type=int, default=default("ttt_steps"))
    p.add_argument("--ttt-step-decay", type=float, default=default("ttt_step_decay"),
                   help="the loss of TTT step k is weighted w^k (EAGLE-3 and SpecForge use 0.8; speculators 1.0, "
                        "every step equal)")
    p.add_argument("--noise-std", type=float, default=default("noise_std"), help="uniform noise in [-s, s] on the captured features")
    p.add_argument("--scheduler", choices=SCHEDULERS, default=default("scheduler"))
    p.add_argument("--warmup-ratio", type=float, default=default("warmup_ratio"))
    p.add_argument("--val-ratio", type=float, default=default("val_ratio"))
    p.add_argument("--sim-depth", type=int, default=default("sim_depth"),
                   help="each validation also simulates chain drafting to this depth on the validation data "
                        "(sim_acc_k, sim_tau_d: trainer/simulate.py); 0: off")
    p.add_argument("--sim-samples", type=int, default=default("sim_samples"),
                   help="validation sequences (packed rows) the simulation reads, over all ranks; 0: all")
    p.add_argument("--batch-size", type=int, default=default("batch_size"),
                   help="sequences per rank in one forward and backward (the micro-batch)")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-size", type=int, default=default("global_batch_size"),
                       help="sequences per optimizer step over all ranks, a multiple of --batch-size x ranks: the "
                            "gradients of that many micro-batches are accumulated (default: no accumulation)")
    batch.add_argument("--global-batch-tokens", type=int, default=default("global_batch_tokens"),
                       help="the same in tokens, counting rows of --max-seq-len tokens (as --pack-samples fills them)")
    p.add_argument("--pack-samples", action="store_true",
                   help="concatenate samples into rows of up to --max-seq-len tokens; attention, RoPE positions and "
                        "targets stay within each sample")
    p.add_argument("--grad-clip", type=float, default=default("grad_clip"))
    p.add_argument("--save-every", type=int, default=default("save_every"), help="checkpoint every N steps too (0: epoch ends only)")
    p.add_argument("--seed", type=int, default=default("seed"))
    p.add_argument("--max-steps", type=int, default=default("max_steps"), help="stop after this many optimizer steps")
    p.add_argument("--no-resume", action="store_true", help="refuse to start when the output dir has checkpoints")
    p.add_argument("--init-from", default=default("init_from"), help="draft weights to start from (a checkpoint or output dir)")
    p.add_argument("--init-lm-head-from-verifier", action="store_true",
                   help="start the draft's lm_head from the verifier's lm_head rows of the draft vocabulary")
    p.add_argument("--report-to", default=default("report_to"), metavar="|".join(TRACKERS),
                   help="experiment trackers, comma-separated; one tracker run per longrun run across attempts")
    p.add_argument("--tracking-dir", default=default("tracking_dir"),
                   help="where trackers write (default: the longrun run's records/<run>/tracking, else <output-dir>/tracking)")
    # draft shape, EAGLE 3.1 and export formats (trainer/model.py)
    p.add_argument("--draft-num-heads", type=int, default=default("draft_num_heads"),
                   help="attention heads of the draft (default: the verifier's; 56 for DeepSeek-V3 / Kimi-K2)")
    p.add_argument("--draft-num-kv-heads", type=int, default=default("draft_num_kv_heads"),
                   help="KV heads of the draft (default: the verifier's; 8 for DeepSeek-V3 / Kimi-K2)")
    p.add_argument("--draft-head-dim", type=int, default=default("draft_head_dim"),
                   help="head dimension of the draft (default: the verifier's; 128 for DeepSeek-V3 / Kimi-K2)")
    p.add_argument("--fc-norm", action="store_true", help="EAGLE 3.1: an RMSNorm per captured feature before fc")
    p.add_argument("--norm-output", action="store_true",
                   help="EAGLE 3.1: each TTT step reads the previous step's hidden state after the final norm")
    p.add_argument("--export-format", default=default("export_format"), type=lambda v: tuple(v.split(",")),
                   help="comma-separated: engine (config.json + model.safetensors in the output dir, always "
                        "written), speculators (speculators' own format in <output-dir>/speculators/)")
    p.add_argument("--eval-corpus", default=default("eval_corpus"),
                   help="held-out text: at the end, measure acceptance by depth (trainer.evaluate) and report it")
    p.add_argument("--eval-max-depth", type=int, default=default("eval_max_depth"))
    p.add_argument("--eval-samples", type=int, default=default("eval_samples"))
    p.add_argument("--eval-new-tokens", type=int, default=default("eval_new_tokens"))
    return p


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The command line's settings, checked, as a TrainConfig (the one place a Namespace becomes one)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.layer_ids:  # `--layer-ids 2,30,58` or `--layer-ids 2 30 58 61`
        args.layer_ids = [i for ids in args.layer_ids for i in ids]
    if args.sim_depth < 0 or args.sim_samples < 0:
        p.error("--sim-depth and --sim-samples must be at least 0")
    if args.ttt_steps < 1 or args.epochs < 1 or args.batch_size < 1 or args.max_seq_len < 2:
        p.error("--ttt-steps, --epochs and --batch-size must be at least 1, --max-seq-len at least 2")
    if args.init_from and args.init_lm_head_from_verifier:
        p.error("--init-from brings its own lm_head; drop --init-lm-head-from-verifier")
    if set(args.export_format) - set(EXPORT_FORMATS):
        p.error(f"--export-format: one or more of {', '.join(EXPORT_FORMATS)}")
    try:
        parse_report_to(args.report_to or "")
    except ValueError as exc:
        p.error(str(exc))
    return TrainConfig.from_flags(vars(args))


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


def open_data(data: DataConfig, verifier: dict) -> StoredData:
    """`--data-dir` in its `--data-format`, opened once for the run, for `verifier` (its config.json): the draft's
    layer ids and the samples come from it."""
    opened = open_training_data(data.data_dir, data.data_format, verifier["num_hidden_layers"], data.layer_ids,
                                verifier.get("hidden_size"))
    if int(os.environ.get("RANK", "0")) == 0:
        for note in opened.notes:  # what was made of the layer ids given (speculators' 4-id form)
            print(note, flush=True)
    return opened


def build_draft(model: ModelConfig, verifier: dict, data: StoredData, ttt_steps: int, dtype: torch.dtype,
                init_from: str | None, seed: int) -> tuple[EagleDraft, VerifierHead]:
    """A new draft (or `init_from`'s weights) shaped after the verifier (`verifier`: its config.json) and
    capturing `data`'s layers, and the head that computes targets."""
    d2t, t2d = load_vocab_mapping(model.vocab_mapping_dir)
    config = DraftConfig.from_verifier(verifier, d2t.numel(), ttt_steps, model.draft_num_heads,
                                       model.draft_num_kv_heads, model.draft_head_dim, model.fc_norm, model.norm_output)
    config.aux_hidden_state_layer_ids = data.layer_ids
    head, embed_weight = load_verifier_head(model.verifier_path, d2t, t2d)
    head.input_is_normed = data.last_hidden_state_normed
    torch.manual_seed(seed)  # identical initial weights on every rank
    draft = EagleDraft(config, embed_weight.to(dtype))
    draft.set_vocab_mapping(d2t, t2d)
    if model.init_lm_head_from_verifier:
        init_lm_head_from_verifier(draft, head)
    if init_from:
        path = init_weights_path(init_from)
        load_weights_with_same_vocab(draft, path)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"initialised the draft from {path}", flush=True)
    return draft, head


@torch.no_grad()
def init_lm_head_from_verifier(draft: EagleDraft, head: VerifierHead) -> None:
    """Row i of the draft's lm_head := the verifier's lm_head row of draft id i's target id (i + d2t[i])."""
    draft.lm_head.weight.copy_(head.draft_rows.to(draft.lm_head.weight.dtype))


def open_datasets(config: DataConfig, data: StoredData, seed: int) -> tuple[Dataset, Dataset | None]:
    """(training set, validation set or None) over the opened `data`, split by `--val-ratio`."""
    train_files, val_files = split_files(data.files, config.val_ratio, seed)
    if not train_files:
        raise SystemExit(f"no training samples in {config.data_dir}; run `python -m trainer.prepare` first")
    val_set = data.dataset(val_files, config.max_seq_len) if val_files else None
    return data.dataset(train_files, config.max_seq_len), val_set


@dataclass
class TrainingData:
    """This rank's training and validation loaders, and how many of their batches make one optimizer step."""

    train: BatchLoader
    val: BatchLoader | None
    train_samples: int
    val_samples: int
    micro_batches_per_step: int

    def micro_batches(self, epoch: int) -> int:
        """This rank's batches in `epoch` (the same on every rank)."""
        return self.train.batch_sampler.batches_in_epoch(epoch)

    def steps(self, epochs: int) -> int:
        """Optimizer steps in the first `epochs` epochs (an epoch's last step may take fewer micro-batches)."""
        return sum(math.ceil(self.micro_batches(e) / self.micro_batches_per_step) for e in range(epochs))


def micro_batches_per_step(data: DataConfig, world_size: int) -> int:
    """How many micro-batches of --batch-size each rank accumulates into one optimizer step."""
    per_micro_step = data.batch_size * world_size
    if data.global_batch_size is not None:
        if data.global_batch_size % per_micro_step:
            raise SystemExit(f"--global-batch-size {data.global_batch_size} is not a multiple of --batch-size x ranks "
                             f"= {per_micro_step}: choose a multiple, or change --batch-size")
        return data.global_batch_size // per_micro_step
    if data.global_batch_tokens is not None:
        return max(1, round(data.global_batch_tokens / (per_micro_step * data.max_seq_len)))
    return 1


def training_data(config: DataConfig, data: StoredData, seed: int, ctx: Distributed,
                  target_hidden_size: int, size_readers: bool = False) -> TrainingData:
    """This rank's loaders over `open_datasets` of the opened `data` (the one call to swap for another layout);
    with `size_readers` the training loader sizes its readers from the measured read rate (ReaderSizing)."""
    train_set, val_set = open_datasets(config, data, seed)
    width = train_set[0]["hidden_states"].shape[-1]
    if width != 3 * target_hidden_size:
        raise SystemExit(
            f"{config.data_dir} holds features {width} wide but the verifier needs 3 x {target_hidden_size}: "
            "was the data prepared with this --verifier-path?"
        )
    shard = dict(seed=seed, rank=ctx.rank, world_size=ctx.world_size, pack=config.pack_samples)
    sizing = ReaderSizing.for_this_host(print if ctx.rank == 0 else lambda line: None) if size_readers else None
    train = make_loader(train_set, config.batch_size, config.num_workers, True, **shard, sizing=sizing)
    val = make_loader(val_set, config.batch_size, 0, False, **shard) if val_set is not None else None
    return TrainingData(train, val, len(train_set), len(val_set) if val_set is not None else 0,
                        micro_batches_per_step(config, ctx.world_size))


def optimizer_steps(batches: Iterable[dict], micro_batches: int) -> Iterator[list[dict]]:
    """Consecutive groups of `micro_batches` batches (the last of an epoch may be shorter)."""
    group: list[dict] = []
    for batch in batches:
        group.append(batch)
        if len(group) == micro_batches:
            yield group
            group = []
    if group:
        yield group


def report_acceptance(evaluation: ValidationConfig, verifier_path: str, draft_dir: Path, reporter: MetricsReporter,
                      step: int, total_steps: int, device: torch.device) -> None:
    """Speculative decoding with the exported draft (in `draft_dir`) on held-out text; one metrics line carries
    the report."""
    from trainer.evaluate import evaluate_draft

    report = evaluate_draft(verifier_path, draft_dir, Path(evaluation.eval_corpus), evaluation.eval_max_depth,
                            evaluation.eval_samples, evaluation.eval_new_tokens, device=str(device))
    taus = {series.indexed(series.EVAL_ACCEPTED, row["depth"]): row["mean_accepted"] for row in report["by_depth"]}
    reporter.write({series.STEP: step, series.TOTAL_STEPS: total_steps, **taus, "evaluation": report})
    print("acceptance by depth: " + " ".join(f"{row['depth']}:{row['mean_accepted']:.2f}" for row in report["by_depth"]),
          flush=True)


def gave_num_workers(argv: Sequence[str]) -> bool:
    """Whether the command line sets --num-workers (then the readers are the user's, not sized by the loader)."""
    return any(arg == "--num-workers" or arg.startswith("--num-workers=") for arg in argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    config = parse_args(argv)
    stop = StopRequest()
    ctx = Distributed.from_environment()
    try:
        return run(config, ctx, stop, size_readers=not gave_num_workers(argv))
    except Exception:
        if stop.requested:  # e.g. a collective broken by a rank that stopped
            return EXIT_TERMINATED
        raise
    finally:
        ctx.close()


def checkpoint_to_resume(output_dir: Path, no_resume: bool, ctx: Distributed) -> Path | None:
    """The latest complete checkpoint in `output_dir` as rank 0 reads it (None: a new run)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    latest = ctx.from_rank0(latest_checkpoint(output_dir))
    if latest is not None and no_resume:
        raise SystemExit(
            f"{output_dir} already has checkpoints (latest {latest.name}) and --no-resume was given: "
            "choose an empty --output-dir, or drop --no-resume to continue that run"
        )
    return latest


def run(config: TrainConfig, ctx: Distributed, stop: StopRequest, size_readers: bool = False) -> int:
    clock: StartupClock | None = startup_clock()
    ttt, optim, saving, validation = config.ttt, config.optim, config.checkpoints, config.validation
    output_dir = Path(saving.output_dir)
    resume_from = checkpoint_to_resume(output_dir, saving.no_resume, ctx)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    log = print if ctx.rank == 0 else (lambda *a, **k: None)
    verifier = read_verifier_config(config.model.verifier_path)
    stored = open_data(config.data, verifier)  # the one reading of --data-dir's layout: the model's and the loaders'

    clock.mark("setup")
    init_from = config.model.init_from if resume_from is None else None
    draft, head = build_draft(config.model, verifier, stored, ttt.ttt_steps, dtype, init_from, config.seed)
    draft.to(ctx.device)
    head = head.to(ctx.device, dtype)
    share_dynamic_profile(draft.config)  # a restart at another TTT compiles the sizes attempt 1 found varying dynamic
    clock.mark("model")
    objective = TTTObjective(draft, ttt.ttt_steps, ttt.ttt_step_decay)
    model = objective if ctx.world_size == 1 else DistributedDataParallel(
        objective, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None, broadcast_buffers=False
    )
    data = training_data(config.data, stored, config.seed, ctx, draft.config.target_hidden_size, size_readers)
    clock.mark("data")
    total_steps = data.steps(optim.epochs)
    if optim.max_steps is not None:
        total_steps = min(total_steps, optim.max_steps)

    optimizer = build_optimizer(draft.parameters(), optim.lr)
    scheduler = build_scheduler(optimizer, optim.scheduler, total_steps, optim.warmup_ratio)
    # The feature noise has its own generator: data loaders draw from the global one as they start.
    noise = torch.Generator(ctx.device).manual_seed(config.seed + 1000 * (ctx.rank + 1))
    train_step = TrainingStep(model, objective, head, optimizer, scheduler, ttt.noise_std, noise, optim.grad_clip)
    checkpointer = Checkpointer(
        output_dir, draft, optimizer, scheduler, {"noise": noise},
        {"total_steps": total_steps, "ttt_steps": ttt.ttt_steps, "args": config.flags()},
        saving.save_every, ctx.rank, ctx.world_size, ctx.barrier,
        export_formats=saving.export_format, verifier_path=str(Path(config.model.verifier_path).resolve()),
    )
    position = Position()
    if resume_from is not None:
        position, saved = checkpointer.restore(resume_from)
        if saved.get("ttt_steps") != ttt.ttt_steps:
            log(f"note: {resume_from.name} was trained with {saved.get('ttt_steps')} TTT steps, continuing with {ttt.ttt_steps}")
        log(f"resuming from {resume_from} at step {position.step} (epoch {position.epoch}, batch {position.batch})")
    log(describe_run(draft, config.data, ttt.ttt_steps, data, ctx, total_steps), flush=True)

    trackers = open_trackers(saving.report_to, output_dir, saving.tracking_dir) if ctx.rank == 0 else None
    reporter = MetricsReporter(metrics_path(output_dir), enabled=ctx.rank == 0, trackers=trackers)
    metrics = TrainingMetrics(reporter, ctx.sum, ctx.world_size, total_steps, ttt.ttt_steps)
    # the readers are sized against the step's own compute time, per batch (the loader cannot see the GPU's)
    metrics.on_step = lambda busy: data.train.observe_step(busy / data.micro_batches_per_step)
    validator = Validator(objective, head, data.val, ctx.sum, ctx.device, dtype, validation.sim_depth,
                          math.ceil(validation.sim_samples / ctx.world_size) if validation.sim_samples else None)
    profiler = StepProfiler(ctx.rank)
    # each batch's trained rows found on the CPU, so that a step never waits for the GPU before it is queued
    plan = functools.partial(plan_trained_rows, target_to_draft=head.target_to_draft.cpu(), ttt_steps=ttt.ttt_steps,
                             pin=ctx.device.type == "cuda")

    # on a GPU the regions compile on a thread of their own while the first steps run eagerly (trainer/compiled.py),
    # from the third step on: the first step's line (published after step 2 is queued) is what a user waits for at a
    # start or a restart, and a compiling thread beside it holds the interpreter (run 8 of docs/benchmarks.md: the
    # first eager step 12.8 s beside it, 7.8 s in run 7)
    background = compiled.ENABLED and compiled.BACKGROUND and ctx.device.type == "cuda"
    compiling: BackgroundCompile | None = None
    if background:
        compiled.defer()  # the steps before the compile starts run eagerly, not compiling on this thread

    def stopped() -> int:
        metrics.publish()  # the step after the one that saw the request ran too
        log(f"stopping at step {position.step} on SIGTERM", flush=True)
        return EXIT_TERMINATED

    try:
        while position.step < total_steps and position.epoch < optim.epochs:
            data.train.batch_sampler.set_epoch(position.epoch, position.batch)
            epoch_batches = data.micro_batches(position.epoch)
            batches = metrics.input_wait.batches(prefetch_to_device(data.train, ctx.device, dtype, plan))
            for micro_batches in optimizer_steps(batches, data.micro_batches_per_step):
                lr = scheduler.get_last_lr()[0]
                if background and compiling is None and position.step >= COMPILE_FROM_STEP:
                    compiling = BackgroundCompile(rehearsal(objective, head, micro_batches[0]))
                elif compiling is not None and (line := compiling.take_over()):
                    log(f"{line} (step {position.step + 1})", flush=True)
                if clock is not None:
                    clock.mark("first batch")  # the loaders' start and the first batch's way to the device
                started, waited = StepStart(ctx.device), metrics.input_wait.take()
                # timed once the compiled regions run (or where nothing compiles): what the rest of the attempt runs
                objective.timer = ChainTimer(ctx.device.type == "cuda") if not background or (
                    compiling is not None and compiling.taken) else None
                result = train_step(micro_batches)
                if clock is not None:
                    warm_up = ": torch.compile warm-up" if ctx.device.type == "cuda" and compiled.ENABLED else ""
                    clock.mark("first step" + (f", eager: torch.compile in the background from step {COMPILE_FROM_STEP + 1}" if background
                                        else warm_up))
                    log(clock.summary(), flush=True)
                    clock = None
                position.step += 1
                position.batch += len(micro_batches)
                previous_stops = metrics.publish()  # the step before this one: its figures are ready by now
                profiler.step()
                metrics.queue(position.step, position.epoch + position.batch / epoch_batches, lr, result.loss,
                              result.stats, result.grad_norm, result.tokens, stop.requested, started, waited,
                              objective.timer)
                if previous_stops:
                    return stopped()
                if position.step >= total_steps:
                    break
                if checkpointer.due(position.step):
                    if metrics.publish():  # a checkpoint never runs ahead of the metrics on disk
                        return stopped()
                    checkpointer.save(position)
            if metrics.publish():
                return stopped()
            val_metrics = validator()
            if val_metrics is not None:
                reporter.validation({series.STEP: position.step, series.TOTAL_STEPS: total_steps,
                                     series.EPOCH: position.epoch + position.batch / epoch_batches, **val_metrics})
            if position.batch >= epoch_batches:
                position.epoch, position.batch = position.epoch + 1, 0
            checkpointer.save(position)
            metrics.pause()
        log(f"done: {position.step} steps; draft exported to {output_dir}", flush=True)
        if validation.eval_corpus and ctx.rank == 0:
            report_acceptance(validation, config.model.verifier_path, output_dir, reporter, position.step, total_steps,
                              ctx.device)
        return 0
    finally:
        if compiling is not None:
            compiling.close()
        profiler.close()
        reporter.close()


def describe_run(draft: EagleDraft, batching: DataConfig, ttt_steps: int, data: TrainingData, ctx: Distributed,
                 total_steps: int) -> str:
    config = draft.config
    n_params = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    sequences = batching.batch_size * ctx.world_size * data.micro_batches_per_step
    batch = f"{sequences} {'packed rows' if batching.pack_samples else 'sequences'} per step"
    if data.micro_batches_per_step > 1:
        batch += f" ({data.micro_batches_per_step} micro-batches of {batching.batch_size} per rank)"
    return (
        f"draft: {n_params / 1e6:.1f}M trainable parameters, hidden {config.hidden_size}, draft vocab "
        f"{config.draft_vocab_size}/{config.vocab_size}, TTT steps {ttt_steps}; {data.train_samples} train / "
        f"{data.val_samples} val samples, {batch}, {ctx.world_size} rank(s) on {ctx.device.type}, {total_steps} steps"
    )


if __name__ == "__main__":
    # torch elastic's @record: a rank's exception goes to TORCHELASTIC_ERROR_FILE, which torchrun (and longrun) read
    sys.exit(record(main)())
