"""The metrics reporter: JSON lines for the supervisor, a short progress line for people; and the
training steps' metrics, reduced over ranks on the device and read one step late."""

import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from trainer import series, step_timing
from trainer.step_timing import ChainTimer
from trainer.timefmt import duration
from trainer.trackers import Trackers
from trainer.ttt import summarize_stats

METRICS_FILE_ENV = "LONGRUN_METRICS_FILE"


def metrics_path(output_dir: str | Path) -> Path:
    """$LONGRUN_METRICS_FILE when set, else <output-dir>/metrics.jsonl."""
    return Path(os.environ.get(METRICS_FILE_ENV) or Path(output_dir) / "metrics.jsonl")


class MetricsReporter:
    """Appends one JSON object per line, flushed at once so that a reader never waits on a buffer.

    Only the reporting rank writes; on the others every call is a no-op. `trackers` get every line too."""

    def __init__(self, path: str | Path, enabled: bool = True, print_every: int = 10, trackers: Trackers | None = None):
        self.enabled = enabled
        self.trackers = trackers if enabled else None
        self.print_every = print_every
        self._first: tuple[int, float] | None = None  # (step before the first one reported, its time)
        self._file: TextIO | None = None
        if enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        record = {"time": time.time(), **record}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        if self.trackers is not None:
            self.trackers.log(record)

    def train_step(self, record: dict) -> None:
        """Write a training line; print a progress line every `print_every` steps and at the last."""
        self.write(record)
        step, total = record[series.STEP], record[series.TOTAL_STEPS]
        if self._first is None:
            self._first = (step - 1, time.time())
        if self.enabled and (step == 1 or step % self.print_every == 0 or step == total):
            first_step, first_time = self._first
            seconds_per_step = (time.time() - first_time) / max(step - first_step, 1)
            print(progress_line(record, seconds_per_step * (total - step)), flush=True)

    def validation(self, record: dict) -> None:
        self.write(record)
        if self.enabled:
            accs = " ".join(f"{record[k]:.3f}" for k in _indexed(record, series.VAL_ACC))
            taus = _indexed(record, series.SIM_TAU)
            sim = f" sim tau@{_step_index(taus[-1])} {record[taus[-1]]:.2f}" if taus else ""
            print(f"[val] step {record[series.STEP]} epoch {record[series.EPOCH]:.2f} loss "
                  f"{record[series.VAL_LOSS]:.4f} acc {accs}{sim}", flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None


def _step_index(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def _indexed(record: dict, base: str) -> list[str]:
    """The record's `base`_k names, by k."""
    pattern = series.indexed_pattern(base)
    return sorted((k for k in record if pattern.match(k)), key=_step_index)


def progress_line(record: dict, eta: float) -> str:
    step, total = record[series.STEP], record[series.TOTAL_STEPS]
    accs = "/".join(f"{record[series.indexed(series.ACC, k)]:.2f}" for k in range(record[series.TTT_STEPS]))
    bound = record.get(series.INPUT_BOUND)
    waiting = (f" input-bound {bound:.0%} ({record[series.DATA_WAIT_S] * 1e3:.0f} of "
               f"{record[series.STEP_TIME_S] * 1e3:.0f} ms waiting for data)"
               if bound is not None and bound >= series.INPUT_BOUND_NOTICE else "")
    return (
        f"[train] step {step}/{total} epoch {record[series.EPOCH]:.2f} loss {record[series.LOSS]:.4f} acc {accs} "
        f"lr {record[series.LR]:.2e} gnorm {record[series.GRAD_NORM]:.3f} {record[series.TOKENS_PER_S]:.0f} tok/s "
        f"ETA {duration(eta)}{waiting}"
    )


class Throughput:
    """Tokens per second over the last `window` steps. A single step's interval is noisy: its metrics are
    read when the next step is queued, which a slow batch can delay."""

    def __init__(self, window: int = 10, clock: Callable[[], float] = time.time):
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


class StepStart:
    """When a step was queued: the host's clock, and on a GPU an event in the compute stream before its first kernel
    (timed, and read only once the step's figures are: no sync of its own)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.host = clock()
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()


class InputWait:
    """How long the training loop waits for its batches: `batches(loader)` times each `next` on the loader (the
    disk read behind it, the pinned copy, the plan), `take()` hands over the wait since the last take (one
    optimizer step's, whatever its micro-batches), and `window(wait, time)` the share of the last `window` steps'
    time spent waiting."""

    def __init__(self, window: int = 10, clock: Callable[[], float] = time.perf_counter):
        self.clock, self.waited = clock, 0.0
        self.steps: deque[tuple[float, float]] = deque(maxlen=window)

    def batches(self, loader: Iterable[dict]) -> Iterator[dict]:
        batches = iter(loader)
        while True:
            asked = self.clock()
            batch = next(batches, None)
            self.waited += self.clock() - asked
            if batch is None:
                return
            yield batch

    def take(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited

    def share(self, wait: float, step_time: float) -> float:
        """The share of the last steps' time (this one's included) spent waiting for data."""
        self.steps.append((wait, step_time))
        return min(1.0, sum(w for w, _ in self.steps) / max(sum(t for _, t in self.steps), 1e-9))

    def reset(self) -> None:
        self.steps.clear()
        self.waited = 0.0


@dataclass
class _QueuedStep:
    """A finished step's metrics, all-reduced on the device and not read yet."""

    step: int
    epoch: float
    lr: float
    values: torch.Tensor  # [loss, grad norm, tokens, stop flag, *stats] summed over ranks, on the host
    stats_shape: torch.Size
    ready: torch.cuda.Event | None  # recorded after the copy to the host (GPU only), timed
    started: StepStart | None = None
    host_wait: float = 0.0  # seconds the loop waited on the loader for this step's batches
    queued_at: float = 0.0  # the host's clock once the step was queued
    timer: ChainTimer | None = None  # the step's TTT chains, where it is timed (trainer/step_timing.py)


class TrainingMetrics:
    """The per-step metrics line of each optimizer step, written one step late.

    Reading a step's metrics at once would make the CPU wait for the GPU every step, and the GPU then
    wait for the CPU to queue the next one: `queue` starts one all-reduce (metrics, and whether any rank
    was asked to stop) and a copy to the host, and `publish`, called once the next step is queued, writes
    the line."""

    def __init__(self, reporter: MetricsReporter, all_ranks_sum: Callable[[torch.Tensor], torch.Tensor],
                 world_size: int, total_steps: int, ttt_steps: int):
        self.reporter, self.all_ranks_sum, self.world_size = reporter, all_ranks_sum, world_size
        self.total_steps, self.ttt_steps = total_steps, ttt_steps
        self.throughput = Throughput()
        self.input_wait = InputWait()
        self.in_flight: _QueuedStep | None = None
        self.previous: _QueuedStep | None = None  # the last step published since the last pause (its end)
        self.on_step: Callable[[float], None] | None = None  # given each step's compute time (less its wait)

    def queue(self, step: int, epoch: float, lr: float, loss: torch.Tensor, stats: torch.Tensor,
              grad_norm: torch.Tensor, tokens: torch.Tensor, stop_requested: bool, started: StepStart | None = None,
              host_wait: float = 0.0, timer: ChainTimer | None = None) -> None:
        """`started`: taken before the step was queued; `host_wait`: the loop's wait for its batches
        (`InputWait.take()`). Without them the line has no `data_wait_s` / `input_bound`."""
        flag = torch.ones(1, device=loss.device) * float(stop_requested)
        packed = self.all_ranks_sum(
            torch.cat([loss.float()[None], grad_norm.float()[None], tokens.float()[None], flag, stats.flatten()])
        )
        if not packed.is_cuda:
            self.in_flight = _QueuedStep(step, epoch, lr, packed, stats.shape, None, started, host_wait,
                                         self.input_wait.clock(), timer)
            return
        # copied now, in stream order, so that reading it waits for this step only, not for the next one queued
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed, non_blocking=True)
        ready = torch.cuda.Event(enable_timing=started is not None)
        ready.record()
        self.in_flight = _QueuedStep(step, epoch, lr, host, stats.shape, ready, started, host_wait,
                                     self.input_wait.clock(), timer)

    def waiting(self, step: _QueuedStep) -> dict:
        """The step's wait for data against its time, once its figures are in (its events complete).

        On the CPU a step runs as it is queued: the wait is idle time, and the step's time runs from the previous
        step's end. On a GPU the host runs ahead, so part of its wait overlaps the GPU's work on the step before:
        the wait counted is the GPU's idle gap between the previous step's end and this one's start, at most
        the host's wait (a gap with the loader ready is not the data's)."""
        if step.started is None:
            return {}
        previous, self.previous = self.previous, step
        wait = step.host_wait
        if step.ready is not None and step.started.event is not None:
            busy = step.started.event.elapsed_time(step.ready) / 1e3
            if previous is not None and previous.ready is not None:
                gap = max(0.0, previous.ready.elapsed_time(step.started.event) / 1e3)
                wait = min(wait, gap)
                step_time = gap + busy
            else:
                step_time = wait + busy
        else:
            since = previous.queued_at if previous is not None else step.started.host - wait
            step_time = step.queued_at - since
        if self.on_step is not None:
            self.on_step(max(0.0, step_time - wait))
        return {series.DATA_WAIT_S: round(wait, 6), series.STEP_TIME_S: round(step_time, 6),
                series.INPUT_BOUND: round(self.input_wait.share(wait, step_time), 4)}

    def publish(self) -> bool:
        """Write the queued step's line (if any); True when a rank was asked to stop at that step."""
        pending, self.in_flight = self.in_flight, None
        if pending is None:
            return False
        if pending.ready is not None:
            pending.ready.synchronize()
        values = pending.values
        stats_sum = values[4:].view(pending.stats_shape).clone()
        stats_sum[:, 0] /= self.world_size
        waited = self.waiting(pending)
        self.reporter.train_step({
            series.STEP: pending.step,
            series.TOTAL_STEPS: self.total_steps,
            series.EPOCH: pending.epoch,
            series.LOSS: values[0].item() / self.world_size,
            **summarize_stats(stats_sum),
            series.GRAD_NORM: values[1].item() / self.world_size,
            series.LR: pending.lr,
            series.TOKENS_PER_S: self.throughput.add(values[2].item()),
            series.TTT_STEPS: self.ttt_steps,
            **waited,
            **step_timing.figures(pending.timer, waited.get(series.STEP_TIME_S), self.ttt_steps),
        })
        return values[3].item() > 0

    def pause(self) -> None:
        """Time from here to the next step is not training (validation, a checkpoint)."""
        self.throughput.reset()
        self.input_wait.reset()
        self.previous = None
