"""A run's stored metrics, every attempt, as TensorBoard event files: for runs trained without a tracker.

The steps follow the trainer's own tracker (trainer/trackers.py): an attempt that resumed continues its
predecessor's numbering, one that started over comes after it; `longrun/attempt` marks where each begins."""

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from trainer.trackers import continued_offset, tag_for

EVENT_FILE_PREFIX = "events.out.tfevents."


@dataclass(frozen=True)
class ExportSummary:
    directory: str
    attempts: list[int]
    series: int
    points: int
    skipped_without_step: int


def _seconds(time: str | datetime) -> float:
    return (time if isinstance(time, datetime) else datetime.fromisoformat(time)).timestamp()


def attempt_offsets(series: dict[str, list[dict[str, Any]]]) -> dict[int, int]:
    """What to add to each attempt's steps so that the run reads as one line of steps."""
    first: dict[int, int] = {}
    last: dict[int, int] = defaultdict(int)
    for points in series.values():
        for p in points:
            if p["step"] is not None:
                first[p["attempt"]] = min(first.get(p["attempt"], p["step"]), p["step"])
                last[p["attempt"]] = max(last[p["attempt"]], p["step"])
    offsets: dict[int, int] = {}
    offset, last_global = 0, 0
    for attempt in sorted(first):
        offset = continued_offset(offset, last_global, first[attempt])
        offsets[attempt] = offset
        last_global = max(last_global, offset + last[attempt])
    return offsets


def write_tensorboard(run: dict[str, Any], series: dict[str, list[dict[str, Any]]], directory: Path) -> ExportSummary:
    """Write the events under directory/<run id>/, replacing an earlier export there."""
    target = directory / run["id"]
    target.mkdir(parents=True, exist_ok=True)
    for old in target.glob(EVENT_FILE_PREFIX + "*"):
        old.unlink()
    offsets = attempt_offsets(series)
    writer = EventFileWriter(str(target))
    points = skipped = 0
    starts: dict[int, tuple[int, float]] = {}
    for name, values in sorted(series.items()):
        for p in values:
            if p["step"] is None:
                skipped += 1
                continue
            step, wall = offsets[p["attempt"]] + p["step"], _seconds(p["time"])
            starts[p["attempt"]] = min(starts.get(p["attempt"], (step, wall)), (step, wall))
            writer.add_event(Event(wall_time=wall, step=step,
                                   summary=Summary(value=[Summary.Value(tag=tag_for(name), simple_value=p["value"])])))
            points += 1
    for attempt, (step, wall) in sorted(starts.items()):
        writer.add_event(Event(wall_time=wall, step=step, summary=Summary(
            value=[Summary.Value(tag="longrun/attempt", simple_value=float(attempt))])))
    writer.close()
    return ExportSummary(str(target), sorted(offsets), len(series), points, skipped)
