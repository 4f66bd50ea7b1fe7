"""The metrics reporter: JSON lines for the supervisor, a short progress line for people."""

import json
import os
import time
from pathlib import Path
from typing import TextIO

METRICS_FILE_ENV = "LONGRUN_METRICS_FILE"


def metrics_path(output_dir: str | Path) -> Path:
    """$LONGRUN_METRICS_FILE when set, else <output-dir>/metrics.jsonl."""
    return Path(os.environ.get(METRICS_FILE_ENV) or Path(output_dir) / "metrics.jsonl")


class MetricsReporter:
    """Appends one JSON object per line, flushed at once so that a reader never waits on a buffer.

    Only the reporting rank writes; on the others every call is a no-op."""

    def __init__(self, path: str | Path, enabled: bool = True, print_every: int = 10):
        self.enabled = enabled
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

    def train_step(self, record: dict) -> None:
        """Write a training line; print a progress line every `print_every` steps and at the last."""
        self.write(record)
        step, total = record["step"], record["total_steps"]
        if self._first is None:
            self._first = (step - 1, time.time())
        if self.enabled and (step == 1 or step % self.print_every == 0 or step == total):
            first_step, first_time = self._first
            seconds_per_step = (time.time() - first_time) / max(step - first_step, 1)
            print(progress_line(record, seconds_per_step * (total - step)), flush=True)

    def validation(self, record: dict) -> None:
        self.write(record)
        if self.enabled:
            accs = " ".join(f"{record[k]:.3f}" for k in sorted((k for k in record if k.startswith("val_acc_")), key=_step_index))
            print(f"[val] step {record['step']} epoch {record['epoch']:.2f} loss {record['val_loss']:.4f} acc {accs}", flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _step_index(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def progress_line(record: dict, eta: float) -> str:
    step, total = record["step"], record["total_steps"]
    accs = "/".join(f"{record[f'acc_{k}']:.2f}" for k in range(record["ttt_steps"]))
    return (
        f"[train] step {step}/{total} epoch {record['epoch']:.2f} loss {record['loss']:.4f} acc {accs} "
        f"lr {record['lr']:.2e} gnorm {record['grad_norm']:.3f} {record['tokens_per_s']:.0f} tok/s "
        f"eta {_duration(eta)}"
    )


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
