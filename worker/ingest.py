"""Storing what a host reported: metric lines and log text, each exactly once.

A metric line's identity is (run, attempt, line number); metrics read from the log are numbered apart
(lines from LOG_LINES_FROM on, see store_log_metrics). Offsets and counters advance in the
same transaction as the inserts, so a crash between reading and storing re-reads the same
bytes and the unique key turns the replay into a no-op.
"""

import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, insert, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from server import proposal
from server.eta import fold_step_time, update_step_rate
from server.layout import METRICS_FILE
from server.models import Attempt, Event, LogChunk, MetricPoint, Run, utcnow
from server.series import SERVER_SERIES
from trainer import series
from worker.log_metrics import PATTERN_SECONDS_PER_READ, LogMetricsConfig, read_log
from worker.metric_values import LOSS_SERIES, NOT_FINITE_MARKERS, Skips, as_step, not_finite

# progress fields, not series
NOT_SERIES = frozenset({"step", "total_steps", "time"})
# metric lines from this number on are records of the log; the metrics file's lines stay below it
LOG_LINES_FROM = 1 << 30
MAX_LINE = 2**31 - 1
# a metric line longer than this, or with more keys, is skipped and counted (what a job writes is untrusted)
MAX_METRIC_LINE_BYTES = 64 * 1024
MAX_KEYS_PER_LINE = 256
MAX_SERIES_NAME = 128
# series names a run's `latest` (and so its store) takes: a job inventing new names on every line stops here
MAX_SERIES_PER_RUN = 1024
# the event that says so, once per run
SERIES_REFUSED = "series_refused"
PATTERN_SLOW = "log_pattern_slow"
FILE_TRUNCATED = "file_truncated"
FILE_REWRITTEN = "file_rewritten"
LOG_SKIPPED = "log_skipped"
LOG_METRICS_PASSED = "log_metrics_passed"
LAST_METRIC_LINE_INVALID = "last_metric_line_invalid"
METRICS_SKIPPED = "metrics_skipped"
LOSS_NOT_FINITE = "loss_not_finite"
# what the run's message says while its loss is not finite
DIVERGED = "the training has diverged"
# a job's `time` is taken when it is a plausible Unix time in seconds (2000-01-01 .. 2100-01-01), else the
# server's: a millisecond timestamp, a negative or far-off one would not even convert
EARLIEST_TIME, LATEST_TIME = 946_684_800.0, 4_102_444_800.0
# the tail of each node's log kept per attempt: older chunks are dropped as new ones come (GET .../logs says so)
MAX_STORED_LOG_BYTES = 64 * 1024 * 1024
# once the job is over, metrics are read from the log's last bytes only (its outcome waits on the reads)
LOG_METRICS_AFTER_END_BYTES = 4 << 20
# metrics events kept per run (the newest; status events are all kept): a week of probes would be 600,000
MAX_METRICS_EVENTS = 10_000


@dataclass
class MetricLines:
    """The records of some metric lines (a skipped line is {} so numbering holds), and why lines were skipped."""

    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def parse_metric_lines(text: str) -> MetricLines:
    """One dict per complete line; a line that is not a JSON object, or too long or too wide, becomes {}."""
    out = MetricLines()
    # split on \n only: a job's \r, \x0b or \u2028 inside a line must not shift the numbering of the lines
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line (or no text at all)
    for raw in lines:
        obj, why = _metric_object(raw)
        if why is not None:
            out.skipped.append(why)
        out.records.append(obj or {})
    return out


def _metric_object(raw: str) -> tuple[dict[str, Any] | None, str | None]:
    """A metric line's object, or None: not a JSON object, or (with why) too long or too wide to be taken."""
    if len(raw.encode("utf-8", "surrogatepass")) > MAX_METRIC_LINE_BYTES:
        return None, f"a line of more than {MAX_METRIC_LINE_BYTES} bytes"
    try:
        # strict=False: a raw control character (a \r, a tab) inside a string does not cost the line
        obj = json.loads(raw, strict=False)
    except (json.JSONDecodeError, RecursionError):
        return None, None
    if isinstance(obj, dict) and len(obj) > MAX_KEYS_PER_LINE:
        return None, f"a line of more than {MAX_KEYS_PER_LINE} keys"
    return (obj, None) if isinstance(obj, dict) else (None, None)


def _as_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None  # an integer beyond a double's range
    return number if math.isfinite(number) else None


def _as_time(value: Any, now: datetime) -> datetime:
    """The job's timestamp when it is a plausible Unix time in seconds, else the server's."""
    t = _as_number(value)
    if t is None or not EARLIEST_TIME <= t <= LATEST_TIME:
        return now
    return datetime.fromtimestamp(t, UTC)


def _plain_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        return False
    return True


def _is_series_name(name: str) -> bool:
    return name not in NOT_SERIES and len(name) <= MAX_SERIES_NAME and not SERVER_SERIES.match(name)


def _insert_ignore(session: Session, table: Any, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    dialect = session.get_bind().dialect.name
    if dialect == "sqlite":
        stmt = sqlite_insert(table).on_conflict_do_nothing()
    elif dialect == "postgresql":
        stmt = pg_insert(table).on_conflict_do_nothing()
    else:
        stmt = insert(table)
    session.execute(stmt, rows)


def store_metrics(session: Session, run: Run, attempt: Attempt, text: str, now: datetime | None = None) -> int:
    """Store the metric lines in `text`, which follow line `attempt.metrics_lines`; returns lines read. The host
    hands back a last line without its newline only once the job is over: one that is no metric line is said."""
    parsed = parse_metric_lines(text)
    if not parsed.records:
        return 0
    unterminated = text.rpartition("\n")[2]
    if unterminated.strip() and _metric_object(unterminated) == (None, None):
        _say_last_line_invalid(session, run, attempt, attempt.metrics_lines + len(parsed.records), unterminated)
    if attempt.metrics_lines == 0:
        _drop_log_metrics(session, run, attempt)
    if parsed.skipped:
        attempt.metrics_skipped += len(parsed.skipped)
        attempt.message = (f"{attempt.metrics_skipped} metric line(s) or value(s) skipped, the last one "
                           f"{parsed.skipped[-1]} (limits: {MAX_METRIC_LINE_BYTES} bytes, {MAX_KEYS_PER_LINE} keys)")
    # after the lines' own count: a value's reason (a diverged loss) is the message that stays
    store_metric_records(session, run, attempt,
                         [(i, obj, None) for i, obj in enumerate(parsed.records, start=attempt.metrics_lines)], now)
    attempt.metrics_lines += len(parsed.records)
    return len(parsed.records)


def store_metric_records(session: Session, run: Run, attempt: Attempt,
                         records: list[tuple[int, dict[str, Any], float | None]], now: datetime | None = None) -> None:
    """Store metric records, each (line, record in the metrics-file vocabulary, the trainer's own seconds
    per step or None); a line is the record's identity within the attempt. Every field is the job's word: a
    value that is not a finite number is shown as the run's latest but stored as no point, a line whose step is no
    step (worker/metric_values.py) is not stored, both counted and said; an implausible time is replaced."""
    now = now or utcnow()
    rows: list[dict[str, Any]] = []
    # an older attempt drained after a restart must not overwrite the new attempt's figures
    current = attempt.number == run.attempt
    latest = dict(run.latest or {}) if current else {}
    sec_per_step, last_step = attempt.sec_per_step, attempt.last_step
    last_time = attempt.last_metric_at.timestamp() if attempt.last_metric_at else None
    refused: list[str] = []
    skips = Skips()
    # lines without the job's time all get this read's time: their step rate is measured once, over the read,
    # from the last step they reach (per line, each read's first line would count the whole read as one step)
    untimed_step, final = None, None
    for i, obj, step_seconds in records:
        step, bad_step = as_step(obj.get("step"))
        if bad_step:
            skips.step(i, bad_step)
            continue
        when = _as_time(obj.get("time"), now)
        timed = when is not now
        for name, value in obj.items():
            v, marker = _as_number(value), not_finite(value)
            if (v is None and marker is None) or not _is_series_name(name):
                continue
            if name not in latest and len(latest) >= MAX_SERIES_PER_RUN:
                refused.append(name)
                continue
            if marker is not None:
                skips.value(i, name, marker, step)
                latest[name] = marker
                continue
            rows.append({"run_id": run.id, "attempt": attempt.number, "line": i, "name": name,
                         "step": step, "value": v, "time": when})
            latest[name] = v
        if isinstance(obj.get("evaluation"), dict):
            # the trainer's acceptance report (trainer.evaluate), sent as one metrics line; JSON without NaN, which
            # PostgreSQL's json refuses
            if _plain_json(obj["evaluation"]):
                attempt.evaluation = obj["evaluation"]
            else:
                skips.evaluation(i)
        total_steps, bad_total = as_step(obj.get("total_steps"))
        if bad_total:
            skips.total_steps(i, bad_total)
        if total_steps is not None:
            attempt.total_steps = total_steps
        if step is not None:
            ts = when.timestamp()
            if attempt.first_step_at is None:
                attempt.first_step_at = now
            if step_seconds is not None and _as_number(step_seconds) is not None and step_seconds >= 0:
                sec_per_step = fold_step_time(sec_per_step, step_seconds)
            elif not timed:
                untimed_step = step if untimed_step is None else max(untimed_step, step)
            else:
                sec_per_step = update_step_rate(sec_per_step, last_step, last_time, step, ts)
            if last_step is None or step > last_step:
                attempt.step_seen_at = now
            if timed or step_seconds is not None:
                last_step, last_time = step, ts
            final = (step, ts)
            latest["step"] = step
    if untimed_step is not None:
        sec_per_step = update_step_rate(sec_per_step, last_step, last_time, untimed_step, now.timestamp())
    if final is not None:
        last_step, last_time = final
    _insert_ignore(session, MetricPoint.__table__, rows)
    attempt.sec_per_step, attempt.last_step = sec_per_step, last_step
    if last_time is not None:
        attempt.last_metric_at = datetime.fromtimestamp(last_time, UTC)
    if attempt.total_steps is not None:
        latest["total_steps"] = attempt.total_steps
    if current:
        run.latest = latest
    session.add(Event(run_id=run.id, kind="metrics",
                      data={"attempt": attempt.number, "lines": len(records), "step": last_step,
                            "latest": {k: latest[k] for k in latest}}))
    _drop_old_metrics_events(session, run.id)
    # a validation's sim_acc_k, or an evaluation (decoding, which calibrates them): the proposal may change
    if current and any(name.startswith(series.SIM_ACC + "_") or name == "evaluation"
                       for _, obj, _ in records for name in obj):
        proposal.after_validation_safely(session, run)
    if refused:
        _say_series_refused(session, run, attempt, refused)
    if skips:
        _say_skipped(session, run, attempt, skips)
    if skips.loss is not None or (current and DIVERGED in (run.message or "")):
        _say_diverged(session, run, attempt, skips, latest if current else None)


def _say_skipped(session: Session, run: Run, attempt: Attempt, skips: Skips) -> None:
    """Count what a read passed over on the attempt, with the last reason in its message; an event per reason the
    first time in the attempt."""
    attempt.metrics_skipped += sum(skips.counts.values())
    said = {e.data.get("reason") for e in session.scalars(select(Event).where(
        Event.run_id == run.id, Event.kind == METRICS_SKIPPED)) if e.data.get("attempt") == attempt.number}
    for reason, words in skips.first.items():
        if reason not in said:
            session.add(Event(run_id=run.id, kind=METRICS_SKIPPED, data={
                "attempt": attempt.number, "reason": reason, "count": skips.counts[reason],
                "message": f"attempt {attempt.number}: {words}; the attempt counts what is skipped"}))
    attempt.message = f"{attempt.metrics_skipped} metric line(s) or value(s) skipped, the last: {skips.last}"


def _say_diverged(session: Session, run: Run, attempt: Attempt, skips: Skips, latest: dict[str, Any] | None) -> None:
    """A non-finite loss: an event the first time in the attempt; while the run's latest (the current attempt's)
    holds one, the run's message and the attempt's say it loudly, and once every loss is a number again the run's
    says that."""
    first = next((e.data for e in session.scalars(select(Event).where(
        Event.run_id == run.id, Event.kind == LOSS_NOT_FINITE)) if e.data.get("attempt") == attempt.number), None)
    if first is None and skips.loss is not None:
        name, marker, step = skips.loss
        first = {"attempt": attempt.number, "name": name, "value": marker, "step": step, "message": (
            f"attempt {attempt.number}: {name} is {marker}{'' if step is None else f' at step {step}'}: {DIVERGED} "
            "(too high a learning rate, an overflow in half precision, a bad batch?); its points stop until it is "
            "finite again. Cancel it, or restart it from an earlier checkpoint")}
        session.add(Event(run_id=run.id, kind=LOSS_NOT_FINITE, data=first))
    if latest is None:
        return
    if any(LOSS_SERIES.match(k) and v in NOT_FINITE_MARKERS for k, v in latest.items()):
        if first is not None:
            attempt.message = f"{first['message']} ({attempt.metrics_skipped} metric line(s) or value(s) skipped)"
            run.message = first["message"]
    elif DIVERGED in (run.message or ""):
        run.message = f"the loss is finite again at step {latest.get('step', '?')} (it was not: see the run's events)"


def _say_series_refused(session: Session, run: Run, attempt: Attempt, names: list[str]) -> None:
    """Once per run, an event saying that new series names are no longer stored, naming the first refused."""
    if session.scalar(select(Event.id).where(Event.run_id == run.id, Event.kind == SERIES_REFUSED).limit(1)):
        return
    session.add(Event(run_id=run.id, kind=SERIES_REFUSED, data={
        "attempt": attempt.number, "limit": MAX_SERIES_PER_RUN, "first": names[0][:MAX_SERIES_NAME],
        "message": f"the run has {MAX_SERIES_PER_RUN} series names, as many as it takes: new names are not stored "
                   f"(first refused: {names[0][:MAX_SERIES_NAME]!r}, in attempt {attempt.number}); series already "
                   "named go on"}))


def _say_last_line_invalid(session: Session, run: Run, attempt: Attempt, line: int, raw: str) -> None:
    """An event saying that the metrics file ended in a line without a newline that is not a JSON object."""
    shown = raw[:200] + ("…" if len(raw) > 200 else "")
    session.add(Event(run_id=run.id, kind=LAST_METRIC_LINE_INVALID, data={
        "attempt": attempt.number, "line": line, "text": shown,
        "message": f"attempt {attempt.number}: the last line of {METRICS_FILE} (its line {line}) has no newline and is "
                   f"not a JSON object, so it is not stored (did the job end while writing it?): {shown!r}"}))


def say_log_skipped(session: Session, run: Run, attempt: Attempt, node: int, start: int, end: int) -> None:
    """An event saying that the host passed over a log's bytes from `start` to `end` (as stored: after what was
    stored of a log written anew) to read only what is kept; the chunks before are dropped, so what is stored
    of the log stays one stretch."""
    session.execute(delete(LogChunk).where(LogChunk.run_id == run.id, LogChunk.attempt == attempt.number,
                                           LogChunk.node == node, LogChunk.end <= end))
    skipped = end - start
    session.add(Event(run_id=run.id, kind=LOG_SKIPPED, data={
        "attempt": attempt.number, "node": node, "from": start, "to": end, "skipped": skipped,
        "message": f"attempt {attempt.number} node {node}: the job ended with more of its log unread than the "
                   f"{MAX_STORED_LOG_BYTES >> 20} MiB kept of it; {skipped} bytes ({skipped / (1 << 20):.1f} MiB, from "
                   f"byte {start} to {end}) were skipped, not read: no text or metric of them is stored (the whole "
                   "log is on the host)"}))


def _say_patterns_slow(session: Session, run: Run, attempt: Attempt, patterns: list[str]) -> None:
    """Once per attempt and pattern, an event saying that a `log_metrics` pattern ran out of its time on a read."""
    said = {tuple(e.data.get(k) for k in ("attempt", "pattern")) for e in session.scalars(
        select(Event).where(Event.run_id == run.id, Event.kind == PATTERN_SLOW))}
    for pattern in patterns:
        if (attempt.number, pattern) in said:
            continue
        session.add(Event(run_id=run.id, kind=PATTERN_SLOW, data={
            "attempt": attempt.number, "pattern": pattern,
            "message": f"log_metrics pattern {pattern[:200]!r} ran out of its {PATTERN_SECONDS_PER_READ:g} s per read of "
                       f"the log (a search that backtracks without end?): it is left out of the rest of each read "
                       "where it does; the other patterns and formats go on. Make it simpler (anchor it, avoid nested "
                       "repeats) and restart"}))


def say_reread(session: Session, run: Run, attempt: Attempt, node: int, reread: dict[str, Any]) -> None:
    """An event saying that the job truncated or wrote anew its metrics file or log: what it holds now is read
    from the start, its lines numbered (its text stored) after what was stored before, none of that lost or
    doubled."""
    name, offset, how = reread["file"], reread["offset"], reread["how"]
    if how == "truncated":
        what = f"truncated {name} below the {offset} bytes already read"
    else:
        what = (f"wrote {name} anew ({'another file in its place' if how == 'replaced' else 'other bytes'} where "
                f"the {offset} bytes already read were)")
    after = (f"its lines are stored after the {attempt.metrics_lines} stored before" if name == METRICS_FILE
             else "its text is stored after the log stored before")
    session.add(Event(run_id=run.id, kind=FILE_TRUNCATED if how == "truncated" else FILE_REWRITTEN, data={
        "attempt": attempt.number, "node": node, "file": name, "offset": offset, "how": how,
        "message": f"attempt {attempt.number} node {node}: the job {what}; it is read again from its start, and "
                   f"{after} (open the file for appending to keep one series)"}))


def _drop_old_metrics_events(session: Session, run_id: str) -> None:
    session.flush()
    oldest_kept = session.scalar(select(Event.id).where(Event.run_id == run_id, Event.kind == "metrics")
                                 .order_by(Event.id.desc()).offset(MAX_METRICS_EVENTS - 1).limit(1))
    if oldest_kept is not None:
        session.execute(delete(Event).where(Event.run_id == run_id, Event.kind == "metrics", Event.id < oldest_kept))


def store_log_metrics(session: Session, run: Run, attempt: Attempt, position: tuple[int, bool], text: str,
                      complete: bool, now: datetime | None = None, left: int | None = None) -> tuple[int, bool]:
    """Metrics from what node 0 printed (worker/log_metrics.py), for jobs that write no metrics file.

    A record's identity is its index in the log, counted in `position` (records read so far, and whether the
    log offset stands mid-record; it moves with the log offset) and stored as line LOG_LINES_FROM + index,
    apart from the metrics file's lines; `complete` says the log ends here. `left`, once the job is over: the
    log's bytes after this read; then only the records in its last LOG_METRICS_AFTER_END_BYTES are read (reading
    records runs at a few MiB/s: the outcome must not wait on a long log's), the others counted and said. Returns
    the new position."""
    config = LogMetricsConfig.from_spec(attempt.typed_spec)
    if config is None or attempt.metrics_lines or not text:
        return position
    first, midline = position
    passed = 0
    if left is not None and left + len(text) > LOG_METRICS_AFTER_END_BYTES:
        text, passed = _records_after(text, len(text) - max(0, LOG_METRICS_AFTER_END_BYTES - left))
        if passed:
            _say_log_metrics_passed(session, run, attempt)
            first, midline = first + passed, False
    got = read_log(text, first, midline, complete, config)
    if got.slow_patterns:
        _say_patterns_slow(session, run, attempt, got.slow_patterns)
    step = attempt.last_step
    shown = dict(run.latest or {}) if attempt.number == run.attempt else {}
    records = []
    for record in got.records:
        if "step" not in record.values and step is not None:
            # a loss printed on a line of its own belongs to the step the bar or the last line reached
            record.values["step"] = step
        if all(shown.get(k) == v for k, v in record.values.items()) or LOG_LINES_FROM + record.index > MAX_LINE:
            continue  # a bar redrawn with nothing new (or a log of more than a billion records)
        step = record.values.get("step", step)
        shown.update(record.values)
        records.append((LOG_LINES_FROM + record.index, record.values, record.step_seconds))
    if records:
        store_metric_records(session, run, attempt, records, now)
    return first + got.consumed, got.midline


def _records_after(text: str, at: int) -> tuple[str, int]:
    """`text` from the start of the first record at or after character `at`, and how many records (each ended by
    a \r or \n, as worker/log_metrics.py splits them) lie before it."""
    ends = [i for i in (text.find("\n", max(0, at - 1)), text.find("\r", max(0, at - 1))) if i >= 0]
    cut = min(ends) + 1 if ends else max(text.rfind("\n"), text.rfind("\r")) + 1
    return text[cut:], text.count("\n", 0, cut) + text.count("\r", 0, cut)


def _say_log_metrics_passed(session: Session, run: Run, attempt: Attempt) -> None:
    """Once per attempt, an event saying that records of the log read after the job's end were not read for
    metrics."""
    if any(e.data.get("attempt") == attempt.number for e in session.scalars(
            select(Event).where(Event.run_id == run.id, Event.kind == LOG_METRICS_PASSED))):
        return
    session.add(Event(run_id=run.id, kind=LOG_METRICS_PASSED, data={
        "attempt": attempt.number, "limit": LOG_METRICS_AFTER_END_BYTES,
        "message": f"attempt {attempt.number}: the job ended with more of its log unread than its last "
                   f"{LOG_METRICS_AFTER_END_BYTES >> 20} MiB; metrics are read from those only, so that its outcome "
                   "does not wait on reading the rest for them (its text is stored all the same)"}))


def _drop_log_metrics(session: Session, run: Run, attempt: Attempt) -> None:
    """The job writes longrun's metrics file after all: that, not its log, is the source of its series."""
    dropped = session.execute(delete(MetricPoint).where(
        MetricPoint.run_id == run.id, MetricPoint.attempt == attempt.number,
        MetricPoint.line >= LOG_LINES_FROM)).rowcount
    if dropped:
        attempt.sec_per_step = attempt.last_step = attempt.total_steps = None
        attempt.first_step_at = attempt.last_metric_at = attempt.step_seen_at = None


def store_log(session: Session, run_id: str, attempt: int, node: int, offset: int, end: int, text: str) -> None:
    """Store one read of a node's log, keeping its last MAX_STORED_LOG_BYTES (whole chunks) and dropping the rest."""
    if end <= offset:
        return
    _insert_ignore(session, LogChunk.__table__, [{"run_id": run_id, "attempt": attempt, "node": node,
                                                  "offset": offset, "end": end, "text": text}])
    if end > MAX_STORED_LOG_BYTES:
        session.execute(delete(LogChunk).where(
            LogChunk.run_id == run_id, LogChunk.attempt == attempt, LogChunk.node == node,
            LogChunk.end <= end - MAX_STORED_LOG_BYTES))
