"""Progress and metrics read from what a trainer prints: tqdm bars, `key=value` lines, JSON or dict lines,
and per-run patterns (the run spec's `log_metrics`).

Pure functions over text the job wrote, which is untrusted: nothing here raises on any input, and anything
that is not sane (too long, not finite, a step outside a 32-bit counter) is skipped. A record is one piece
of the log between line ends, `\\n` or `\\r` (tqdm redraws its bar after a `\\r`), numbered from the start of
the log; Rich's wrapped log lines (speculators' logger) are joined back into the record they began.
Records come out in the vocabulary of longrun's metrics file (`step`, `total_steps`, one key per series).
"""

import ast
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import regex

from server import log_patterns
from server.log_patterns import FORMATS, FoundTotal, compile_pattern
from server.spec import LogMetricsSpec, RunCreate
from worker.metric_values import MAX_STEP
from worker.protocol import TotalsQuery

# a longer record is not a progress line (and would be slow to scan)
MAX_RECORD_CHARS = 16384
MAX_SERIES_PER_RECORD = 64
# a run's own pattern may backtrack without end: each search, and each pattern's searches in one read, get a time
# limit; a pattern that runs out of it (or whose one search does) is left out for the rest of the read, the others
# keep theirs
PATTERN_SECONDS = 0.05
PATTERN_SECONDS_PER_READ = 1.0
MAX_ABS_VALUE = 1e300
STEP_KEYS = ("step", "global_step", "iteration", "iter")
TOTAL_KEYS = ("total_steps", "max_steps", "num_steps")

NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
NAME_RE = re.compile(r"^[A-Za-z_][\w./-]{0,127}$")
ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]")
# `train:  45%|████▌     | 450/1000 [01:23<01:40,  5.43it/s, loss=2.31]`; the bar itself may be any characters
TQDM_RE = re.compile(
    r"(?P<pct>\d{1,3})%\|[^|]*\|\s*(?P<n>\d+(?:\.\d+)?[kMGTPEZY]?)/(?P<total>\d+(?:\.\d+)?[kMGTPEZY]?)"
    r"\s*\[(?P<elapsed>[\d:]+)<(?P<left>[\d:?]+),\s*(?P<rate>[\d.]+|\?)\s*(?P<unit>\S*?)(?:,\s*(?P<postfix>[^\]]*))?\]")
SCALE = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}
# `step 50`, `Step 10/100`, `global_step=7`, `iter: 3`
STEP_PHRASE_RE = re.compile(r"(?<![\w/.])(?:global_step|step|iteration|iter)\s*[=:]?\s*(\d+)(?:\s*/\s*(\d+))?(?![\w.])",
                            re.IGNORECASE)
KEY = r"(?<![\w./-])([A-Za-z_][\w./-]*)"
# `loss=2.31`, `loss: 2.31` (a space after the colon, so that `trainer.py:498` is no pair)
PAIR_RE = re.compile(KEY + rf"\s*(?:=\s*|:\s+)({NUMBER}|nan|inf|-inf)(?![\w.:/])", re.IGNORECASE)
# `loss 2.31`, only on a line that names its step (the bundled trainer's `[train] step 5/60 loss 2.13 lr 3e-05`)
SPACED_PAIR_RE = re.compile(KEY + rf"\s+({NUMBER})(?![\w.:/])")
# Rich's log handler: `[12:00:01] INFO     message   file.py:42`, continued on lines indented past the level
RICH_HEADER_RE = re.compile(r"^(?:\[[^\]]{1,40}\]|\s+)\s*(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s{2,}\S")
RICH_CONTINUATION_RE = re.compile(r"^\s{8,}\S")
# a line that says the run's total and nothing of a step: SpecForge's scripts/train_eagle3.py prints
# `rank 0: Auto-calculated total_steps: 1200 (num_epochs=2 * steps_per_epoch=600)` (or `Using provided total_steps:
# 500`) before its first step
TOTAL_PHRASE_RE = re.compile(r"(?<![\w./-])total_steps\s*(?:=|:\s)\s*(\d{1,10})(?![\w.])")


@dataclass(frozen=True)
class LogMetricsConfig:
    """How a run's log is read: which built-in formats, which patterns, and a total when the log has none."""

    formats: frozenset[str] = frozenset(FORMATS)
    patterns: tuple[regex.Pattern[str], ...] = ()
    total_steps: int | None = None

    @classmethod
    def from_spec(cls, spec: RunCreate) -> "LogMetricsConfig | None":
        """The run's settings; None when its log is not read for metrics (the bundled trainer writes its own)."""
        if spec.trainer is not None:
            return None
        given = spec.log_metrics or LogMetricsSpec()
        try:
            patterns = tuple(compile_pattern(p) for p in given.patterns)
        except ValueError:
            patterns = ()  # checked when the run was submitted; an older spec must not stop the worker
        config = cls(frozenset(given.formats), patterns, spec.stated_total_steps)
        return config if config.formats or config.patterns else None


@dataclass
class LogRecord:
    """One record's metrics in the metrics-file vocabulary; `step_seconds` is the trainer's own pace (tqdm's rate)."""

    index: int
    values: dict[str, Any] = field(default_factory=dict)
    step_seconds: float | None = None


@dataclass
class LogRead:
    """What one read of the log gave: its records, how many it consumed, and whether it ended mid-record."""

    records: list[LogRecord]
    consumed: int
    midline: bool
    # the run's patterns left out of part of this read for running out of time (their source)
    slow_patterns: list[str] = field(default_factory=list)


class PatternBudget:
    """Each pattern's time left in one read; a pattern whose time is out is left out of the rest of it."""

    def __init__(self, count: int, seconds: float = PATTERN_SECONDS_PER_READ):
        self.left = [seconds] * count

    def search(self, index: int, pattern: regex.Pattern[str], text: str) -> regex.Match[str] | None:
        if self.left[index] <= 0:
            return None
        started = time.monotonic()
        try:
            return pattern.search(text, timeout=min(self.left[index], PATTERN_SECONDS))
        except (TimeoutError, RecursionError, MemoryError):
            self.left[index] = 0.0  # one search that long: the pattern backtracks without end on this log
            return None
        finally:
            self.left[index] -= time.monotonic() - started

    def out_of_time(self) -> list[int]:
        return [i for i, left in enumerate(self.left) if left <= 0]


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) and abs(value) <= MAX_ABS_VALUE else None


def _value(value: Any) -> float | None:
    """A series' value: a number, NaN and ±inf included (a diverged loss is shown, worker/metric_values.py)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return float(value) if abs(value) <= MAX_ABS_VALUE else None
    if isinstance(value, str) and len(value) < 64:
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, float):
        return value if not math.isfinite(value) or abs(value) <= MAX_ABS_VALUE else None
    return None


def _count(value: Any) -> int | None:
    """A step or total: a whole number within a 32-bit counter."""
    number = _value(value)
    if number is None or not math.isfinite(number) or number != int(number) or not 0 <= number <= MAX_STEP:
        return None
    return int(number)


def _scaled(text: str) -> int | None:
    suffix = text[-1] if text and text[-1] in SCALE else ""
    number = _number(text[: len(text) - len(suffix)])
    return None if number is None else _count(round(number * SCALE.get(suffix, 1)))


def _flatten(obj: Any, prefix: str, out: dict[str, Any], depth: int = 0) -> None:
    """Nested dicts as `outer/inner`, lists as `name/0`, `name/1` (the separators speculators and SpecForge use)."""
    if depth > 4 or len(out) > MAX_SERIES_PER_RECORD:
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(value, f"{prefix}{key}/" if isinstance(key, str) else prefix, out, depth + 1)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj[:MAX_SERIES_PER_RECORD]):
            _flatten(value, f"{prefix}{i}/", out, depth + 1)
    elif prefix:
        out[prefix[:-1]] = obj


def _object_in(text: str) -> dict[str, Any] | None:
    """The JSON object, or Python dict literal (HF Trainer, SpecForge), that the record carries."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    body = text[start: end + 1]
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        try:
            # Python's repr writes nan and inf bare; as names they would not be literals, as strings they are read
            obj = ast.literal_eval(re.sub(r"(?<![\w'\"])-?(?:nan|inf)(?![\w'\"])", lambda m: repr(m[0]), body))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    if not isinstance(obj, dict):
        return None
    flat: dict[str, Any] = {}
    _flatten(obj, "", flat)
    return flat


def _is_loss(name: str) -> bool:
    return "loss" in name.lower().rsplit("/", 1)[-1]


def _take(pairs: dict[str, Any], out: dict[str, Any]) -> None:
    """Sane pairs into `out`: step and total under their own names, the rest as series."""
    for name, raw in pairs.items():
        if not isinstance(name, str) or not NAME_RE.match(name) or len(out) >= MAX_SERIES_PER_RECORD:
            continue
        lower = name.lower()
        if lower in STEP_KEYS:
            step = _count(raw)
            if step is not None and ("step" not in out or lower == "step"):
                out["step"] = step
        elif lower in TOTAL_KEYS:
            total = _count(raw)
            if total:
                out["total_steps"] = total
        elif lower != "time" and (value := _value(raw)) is not None:  # a metrics line's `time` is its timestamp
            out[name] = value


def parse_tqdm(text: str) -> tuple[dict[str, Any], float | None, int] | None:
    """A tqdm bar with a total: step, total_steps and the postfix's numbers, seconds per iteration, and where
    the bar ends (a log line printed while the bar is drawn follows it on the same line)."""
    bar = TQDM_RE.search(text)
    if bar is None:
        return None
    n, total = _scaled(bar["n"]), _scaled(bar["total"])
    if n is None or not total:
        return None
    out: dict[str, Any] = {"step": n, "total_steps": total}
    if bar["postfix"]:
        _take({m[1]: m[2] for m in PAIR_RE.finditer(bar["postfix"])}, out)
    rate = _number(bar["rate"]) if bar["rate"] != "?" else None
    seconds = None
    if rate and rate > 0 and bar["unit"].endswith("/s"):
        seconds = 1.0 / rate
    elif rate and rate > 0 and bar["unit"].startswith("s/"):
        seconds = rate
    return out, seconds, bar.end()


def parse_line(text: str, formats: frozenset[str]) -> dict[str, Any]:
    """A log line's metrics (a JSON object or dict literal, or key=value pairs), or {} when it is no progress
    line: one that names neither a step nor a loss."""
    phrase = STEP_PHRASE_RE.search(text)
    pairs: dict[str, Any] = {}
    obj = _object_in(text) if "json" in formats else None
    if obj is not None:
        pairs.update(obj)
    elif "key_value" in formats:
        pairs.update((m[1], m[2]) for m in PAIR_RE.finditer(text))
        if phrase is not None:
            for m in SPACED_PAIR_RE.finditer(text):
                pairs.setdefault(m[1], m[2])
    if phrase is not None:
        pairs.setdefault("step", phrase[1])
        if phrase[2] is not None:
            pairs.setdefault("total_steps", phrase[2])
    out: dict[str, Any] = {}
    _take(pairs, out)
    # numbers with neither a step nor a loss are a configuration dump, not progress; a total said on its own is
    if "step" in out or any(_is_loss(k) for k in out):
        return out
    total = TOTAL_PHRASE_RE.search(text)
    return {"total_steps": count} if total and (count := _count(total[1])) else {}


def parse_record(text: str, config: LogMetricsConfig,
                 budget: PatternBudget | None = None) -> tuple[dict[str, Any], float | None] | None:
    """The metrics of one record, or None when it has none; `text` has no line ends. The run's patterns are
    searched each within its time left in `budget` (one read's)."""
    if len(text) > MAX_RECORD_CHARS:
        return None
    text = ANSI_RE.sub("", text)
    out: dict[str, Any] = {}
    seconds = None
    if "tqdm" in config.formats and (bar := parse_tqdm(text)) is not None:
        out, seconds, end = bar
        text = text[end:]
    if config.formats & {"json", "key_value"}:
        for name, value in parse_line(text, config.formats).items():
            out.setdefault(name, value)
    budget = budget or PatternBudget(len(config.patterns))
    for i, pattern in enumerate(config.patterns):
        found = budget.search(i, pattern, text)
        if found is not None:
            _take({k: v for k, v in found.groupdict().items() if v is not None}, out)
    return (out, seconds) if out else None


def _records(text: str, midline: bool, complete: bool) -> tuple[list[tuple[int, str]], int, bool]:
    """Split into (index, record) with Rich's continuation lines joined; the first record continues the last
    read's when `midline`. The final piece counts only when it ends with a line end, or `complete` says the
    log ends there."""
    pieces = re.split(r"\r|\n", text)
    tail = pieces.pop()
    ends_midline = bool(tail) and not complete
    if tail and complete:
        pieces.append(tail)
    out: list[tuple[int, str]] = []
    rich = False
    for i, piece in enumerate(pieces):
        if i == 0 and midline:
            continue  # the end of a record read in pieces: too long to be a progress line
        header = bool(RICH_HEADER_RE.match(piece))
        if rich and not header and RICH_CONTINUATION_RE.match(piece) and len(out[-1][1]) < MAX_RECORD_CHARS:
            out[-1] = (out[-1][0], out[-1][1] + " " + piece.strip())
            continue
        rich = header
        if piece:
            out.append((i, piece))
    return out, len(pieces), ends_midline


def read_log(text: str, first_index: int, midline: bool, complete: bool, config: LogMetricsConfig) -> LogRead:
    """The metric records in one read of the log, which starts at record `first_index`."""
    pieces, consumed, ends_midline = _records(text, midline, complete)
    budget = PatternBudget(len(config.patterns))
    records = []
    for i, piece in pieces:
        parsed = parse_record(piece, config, budget)
        if parsed is not None:
            values, seconds = parsed
            if config.total_steps and "step" in values:
                values.setdefault("total_steps", config.total_steps)
            records.append(LogRecord(first_index + i, values, seconds))
    return LogRead(records, consumed, ends_midline, [config.patterns[i].pattern for i in budget.out_of_time()])


def totals_query(spec: RunCreate) -> TotalsQuery | None:
    """What node 0's launch asks its host to read for the run's total steps (LaunchRequest.totals): for an
    entrypoint run of speculators' or SpecForge's `train` whose spec and arguments state none."""
    if spec.trainer is not None or spec.stated_total_steps:
        return None
    query = log_patterns.totals_query(spec.entrypoint, list(spec.args), spec.cwd)
    return TotalsQuery(**query) if query else None


def found_total(spec: RunCreate, facts: Any) -> FoundTotal | None:
    """The run's total steps from what its host read for `totals_query(spec)` (LaunchAnswer.totals), with how it
    was found (`note`: an estimate says so and from what); None where the host could not read it."""
    query = totals_query(spec)
    if query is None:
        return None
    ranks = log_patterns.launch_ranks(spec.entrypoint, list(spec.args), spec.ranks)
    return log_patterns.total_from_facts(query.trainer, facts, ranks)
