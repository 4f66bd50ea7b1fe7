"""The metrics reporter: JSON lines for the supervisor, a short progress line for people; and the
training steps' metrics, reduced over ranks on the device and read one step late."""

import json
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from trainer import series
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
    return (
        f"[train] step {step}/{total} epoch {record[series.EPOCH]:.2f} loss {record[series.LOSS]:.4f} acc {accs} "
        f"lr {record[series.LR]:.2e} gnorm {record[series.GRAD_NORM]:.3f} {record[series.TOKENS_PER_S]:.0f} tok/s "
        f"ETA {duration(eta)}"
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


@dataclass
class _QueuedStep:
    """A finished step's metrics, all-reduced on the device and not read yet."""

    step: int
    epoch: float
    lr: float
    values: torch.Tensor  # [loss, grad norm, tokens, stop flag, *stats] summed over ranks, on the host
    stats_shape: torch.Size
    ready: torch.cuda.Event | None  # recorded after the copy to the host (GPU only)


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
        self.in_flight: _QueuedStep | None = None

    def queue(self, step: int, epoch: float, lr: float, loss: torch.Tensor, stats: torch.Tensor,
              grad_norm: torch.Tensor, tokens: torch.Tensor, stop_requested: bool) -> None:
        flag = torch.ones(1, device=loss.device) * float(stop_requested)
        packed = self.all_ranks_sum(
            torch.cat([loss.float()[None], grad_norm.float()[None], tokens.float()[None], flag, stats.flatten()])
        )
        if not packed.is_cuda:
            self.in_flight = _QueuedStep(step, epoch, lr, packed, stats.shape, None)
            return
        # copied now, in stream order, so that reading it waits for this step only, not for the next one queued
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self.in_flight = _QueuedStep(step, epoch, lr, host, stats.shape, ready)

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
        })
        return values[3].item() > 0

    def pause(self) -> None:
        """Time from here to the next step is not training (validation, a checkpoint)."""
        self.throughput.reset()
