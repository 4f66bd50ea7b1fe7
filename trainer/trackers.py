"""Experiment trackers (`--report-to tensorboard,wandb`): one tracker run per longrun run, across retries and
restarts.

Under longrun the job's $LONGRUN_ATTEMPT_DIR is <records>/<run id>/<attempt>, so every attempt of a run finds
the same tracking directory, <records>/<run id>/tracking (never emptied by a clean restart), and the same run
id. Steps continue across attempts: an attempt that resumes from a checkpoint at step s logs at the step its
predecessors' lineage had there (TensorBoard drops what the crashed attempt logged past s); an attempt that
starts again at step 1 (a clean restart, a warm start) logs after everything logged before. The attempt is
logged as the scalar `longrun/attempt` and, in W&B, as a tag.

Without the packages the trainer says so once and trains on: tensorboard is the optional extra `tracking`,
wandb its own package; W&B runs offline unless WANDB_MODE says otherwise (`wandb sync` uploads later)."""

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("tensorboard", "wandb")
INSTALL = {"tensorboard": "pip install 'longrun[tracking]'", "wandb": "pip install wandb"}
LINEAGE_FILE = "longrun-steps.json"
NOT_SCALARS = frozenset({"step", "total_steps", "time"})
# the GPU series the service stores beside a run's metrics (server/series.py; tests/test_shared_names.py pins this copy)
GPU_METRIC = re.compile(r"^(node\d+_)?gpu_(util|mem)_\d+$")


def parse_report_to(value: str) -> list[str]:
    """"tensorboard,wandb" -> the tracker names; "none" or "" -> []; an unknown name raises ValueError."""
    names = [n.strip() for n in value.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"--report-to: unknown tracker {', '.join(unknown)} (known: {', '.join(TRACKERS)})")
    return list(dict.fromkeys(names))


def tag_for(name: str) -> str:
    """The tracker's name for a metric: grouped as train/, val/, eval/ or system/ (the GPUs)."""
    if name.startswith("val_"):
        return f"val/{name}"
    if name.startswith("eval_"):
        return f"eval/{name}"
    if GPU_METRIC.match(name):
        return f"system/{name}"
    return f"train/{name}"


def continued_offset(previous_offset: int, last_global_step: int, first_step: int) -> int:
    """What to add to an attempt's own steps: an attempt that resumed (its first step past 1) continues its
    predecessor's numbering; one that started over comes after everything logged before."""
    return previous_offset if first_step > 1 else last_global_step


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, int | float) and not isinstance(v, bool)}


@dataclass(frozen=True)
class TrackedRun:
    """Which tracker run the records go to: its name, the attempt (None outside longrun), its directory."""

    name: str
    attempt: int | None
    directory: Path


def tracked_run(output_dir: str | Path, tracking_dir: str | Path | None = None,
                env: Mapping[str, str] | None = None) -> TrackedRun:
    # os.environ is looked up per call, not bound as a default: `datasets` rebinds it (Dataset.map with
    # num_proc), and a default bound to the old mapping then misses every variable set since
    attempt_dir = (os.environ if env is None else env).get("LONGRUN_ATTEMPT_DIR")
    if attempt_dir:
        path = Path(attempt_dir)
        if path.name.startswith("node"):  # a later node's dir: <records>/<run>/<attempt>/node<i>
            path = path.parent
        if path.name.isdigit():
            run_dir = path.parent
            return TrackedRun(run_dir.name, int(path.name), Path(tracking_dir or run_dir / "tracking"))
    output = Path(output_dir).resolve()
    # outside longrun the output directory names the run; its path tells apart two of the same name
    name = f"{output.name}-{hashlib.sha256(str(output).encode()).hexdigest()[:8]}"
    return TrackedRun(name, None, Path(tracking_dir or output / "tracking"))


class StepLineage:
    """The global step numbering across attempts, kept in <tracking dir>/longrun-steps.json."""

    def __init__(self, directory: Path):
        self.path = directory / LINEAGE_FILE
        try:
            self.state = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self.state = {"attempts": 0, "offset": 0, "last_step": 0}
        self.offset = 0

    def start(self, attempt: int | None, first_step: int) -> tuple[int, int]:
        """Begin an attempt whose first record has `first_step`: (its offset, its attempt number)."""
        number = attempt if attempt is not None else self.state["attempts"] + 1
        self.offset = continued_offset(self.state["offset"], self.state["last_step"], first_step)
        self.state.update(attempts=number, offset=self.offset, last_step=self.offset + first_step - 1)
        self._save()
        return self.offset, number

    def advance(self, global_step: int) -> None:
        if global_step != self.state["last_step"]:
            self.state["last_step"] = global_step
            self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps(self.state))
        partial.replace(self.path)


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int, wall_time: float | None) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run: TrackedRun, attempt: int, first_global_step: int, resumed: bool):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides what a crashed attempt logged past the checkpoint this one resumed from
        # the writer's own thread writes; every 10 s bounds what a SIGKILL loses without a flush per step
        self.writer = SummaryWriter(log_dir=str(run.directory / "tensorboard"),
                                    purge_step=first_global_step if resumed else None, flush_secs=10)
        self.writer.add_text("longrun/attempts", f"attempt {attempt} starts at step {first_global_step}",
                             first_global_step)

    def log(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step, walltime=wall_time)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run: TrackedRun, attempt: int):
        import wandb

        run.directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "longrun"), id=run.name, name=run.name,
                              resume="allow", mode=os.environ.get("WANDB_MODE", "offline"), dir=str(run.directory))
        self.run.tags = tuple(dict.fromkeys([*(self.run.tags or ()), f"attempt-{attempt}"]))

    def log(self, values: dict[str, float], step: int, wall_time: float | None) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """Sends each metrics record to the chosen trackers, on the run's one step numbering. The trackers open at
    the first record: its step says whether this attempt resumed."""

    def __init__(self, names: list[str], run: TrackedRun):
        self.names, self.run = names, run
        self.lineage = StepLineage(run.directory)
        self.opened: list[Tracker] | None = None

    def _open(self, first_step: int) -> list[Tracker]:
        offset, attempt = self.lineage.start(self.run.attempt, first_step)
        first_global = offset + first_step
        opened: list[Tracker] = []
        for name in self.names:
            try:
                if name == "tensorboard":
                    opened.append(TensorBoardTracker(self.run, attempt, first_global, resumed=first_step > 1))
                else:
                    opened.append(WandbTracker(self.run, attempt))
            except ImportError:
                print(f"[trackers] {name} is not installed ({INSTALL[name]}); not reporting to it", flush=True)
                continue
            print(f"[trackers] {name}: run {self.run.name}, attempt {attempt}, step {first_global}, "
                  f"in {self.run.directory}", flush=True)
        for tracker in opened:
            tracker.log({"longrun/attempt": float(attempt)}, first_global, None)
        return opened

    def log(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        if self.opened is None:
            self.opened = self._open(step)
        global_step = self.lineage.offset + step
        values = {tag_for(k): v for k, v in scalars(record).items()}
        for tracker in self.opened:
            tracker.log(values, global_step, record.get("time"))
        self.lineage.advance(global_step)

    def close(self) -> None:
        for tracker in self.opened or []:
            tracker.close()


def open_trackers(report_to: str | None, output_dir: str | Path, tracking_dir: str | Path | None = None) -> Trackers | None:
    """The trackers `--report-to` names (None when none); the directory is $LONGRUN_ATTEMPT_DIR's run's."""
    names = parse_report_to(report_to or "")
    return Trackers(names, tracked_run(output_dir, tracking_dir)) if names else None
