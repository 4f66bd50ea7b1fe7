"""What a job's metric line holds, judged value by value: a finite number is a point, a non-finite one (NaN,
±Infinity, an integer beyond a double) is shown but not charted, a step that no column holds is no step.

Nothing of it vanishes: each value or line passed over is counted on its attempt (`metrics_skipped`) with why, said
once per attempt and reason in a `metrics_skipped` event, and a non-finite value becomes the run's latest value as
a string marker (JSON has no NaN: "NaN", "Infinity", "-Infinity", the spellings Python's json and JavaScript's
Number() read back). A non-finite loss is said loudly: the run's message and a `loss_not_finite` event.

Steps: a non-negative integer a 32-bit column holds (a float with no fraction, 8.0, is that integer). Anything
else is not a step (W&B's `run.log` takes `step: int | None`, wandb/sdk/wandb_run.py 0.19.1), and the line's
values are not stored against no step, where a chart over steps would lose them: "7" is a string, 8.5 and true
are not whole numbers, -5 is negative, 2^31 and beyond do not fit. A line without a step is
stored without one (charted over time)."""

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# a step or step count the database holds on every backend (INTEGER is 32-bit on PostgreSQL)
MAX_STEP = 2**31 - 1
# the markers the run's latest holds for a non-finite value
NAN, INFINITY, MINUS_INFINITY = "NaN", "Infinity", "-Infinity"
NOT_FINITE_MARKERS = frozenset({NAN, INFINITY, MINUS_INFINITY})
# a loss: the trainer's loss, loss_k, val_loss, val_loss_k (trainer/series.py), and any job's of those names
LOSS_SERIES = re.compile(r"^(?:val_)?loss(?:_\d+)?$")

# why a value or line is passed over: the event's `reason`
NOT_FINITE = "not_finite"
BAD_STEP = "bad_step"
BAD_TOTAL_STEPS = "bad_total_steps"
BAD_EVALUATION = "bad_evaluation"


def not_finite(value: Any) -> str | None:
    """The marker of a number that is not finite (NaN, ±Infinity, an integer beyond a double's range), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:
            return INFINITY if value > 0 else MINUS_INFINITY
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return NAN if math.isnan(value) else (INFINITY if value > 0 else MINUS_INFINITY)
    return None


def as_step(value: Any) -> tuple[int | None, str | None]:
    """(the step, None), or (None, why it is no step); (None, None) where there is none (absent, null)."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, f"{_shown(value)} is a {type(value).__name__}, not a number"
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None, f"{_shown(value)} is not a whole number"
        value = int(value)
    if value < 0:
        return None, f"{_shown(value)} is negative"
    if value > MAX_STEP:
        return None, f"{_shown(value)} is beyond {MAX_STEP}, the largest step stored"
    return value, None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


@dataclass
class Skips:
    """What one read passed over: a count per reason and the first words of each."""

    counts: Counter[str] = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)
    last: str = ""
    # the first non-finite loss of the read: (name, marker, step)
    loss: tuple[str, str, int | None] | None = None

    def add(self, reason: str, words: str) -> None:
        self.counts[reason] += 1
        self.first.setdefault(reason, words)
        self.last = words

    def value(self, line: int, name: str, marker: str, step: int | None) -> None:
        at = f"step {step}" if step is not None else f"line {line}"
        self.add(NOT_FINITE, f"{name} was {marker} at {at} (a non-finite value is shown as the run's latest, not "
                             "stored as a point)")
        if self.loss is None and LOSS_SERIES.match(name):
            self.loss = (name, marker, step)

    def step(self, line: int, why: str) -> None:
        self.add(BAD_STEP, f"line {line}'s step {why}: the line's values are not stored (a step is a whole "
                           f"number from 0 to {MAX_STEP})")

    def total_steps(self, line: int, why: str) -> None:
        self.add(BAD_TOTAL_STEPS, f"line {line}'s total_steps {why}: it is not taken")

    def evaluation(self, line: int) -> None:
        self.add(BAD_EVALUATION, f"line {line}'s evaluation holds NaN or ±Infinity: it is not taken")

    def __bool__(self) -> bool:
        return bool(self.counts)
