"""An attempt's log as stored (worker/ingest.py keeps each node's last 64 MiB, in the reads the host made), read
within a bound per answer: a server holding 64 MiB of one log must not hold it whole for each request.

A tail reads stored reads from the end, one at a time, until it has the lines asked for or `ANSWER_BYTES` of
text; a read from an offset goes forward the same way, whole lines up to ANSWER_BYTES, and says `more` where it
stopped at the bound (the next answer goes on from its `next_offset`, inside a stored read if need be). Each
request holds at most a few stored reads (worker/hostside/files.py READ_LIMIT, 4 MiB each) in memory. A line
longer than `LINE_CHARS` is cut there with a marker saying how long it was: a 10 MiB line is not a line anyone
reads in a terminal or a page (the whole of it is in the file on the host)."""

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.models import LogChunk

# the text an answer gathers before it stops (a tail: before it stops reading further back)
ANSWER_BYTES = 1 << 20
# a line is shown up to this many characters (as a metric line may be long: worker/ingest.py MAX_METRIC_LINE_BYTES)
LINE_CHARS = 64 << 10


@dataclass
class LogPage:
    lines: list[str]
    next_offset: int
    dropped: int
    more: bool


def cut_line(line: str) -> str:
    """The line, or its first LINE_CHARS characters and a marker naming how long it is."""
    if len(line) <= LINE_CHARS:
        return line
    return (f"{line[:LINE_CHARS]} … [longrun: line cut at {LINE_CHARS:,} of its {len(line):,} characters; the "
            "whole line is in the log file on the host]")


def read_log(session: Session, run_id: str, attempt: int, node: int, tail: int | None,
             since_offset: int | None) -> LogPage:
    """The last `tail` lines (of what lies from `since_offset` on), or the lines from `since_offset` on (0: the
    start of what is kept), each within the bounds above."""
    base = [LogChunk.run_id == run_id, LogChunk.attempt == attempt, LogChunk.node == node]
    start = since_offset or 0
    if tail is None and (inside := _inside(session, base, start)) is not None:
        return _forward(session, base, inside, 0)  # a page that ended inside a stored read goes on from there
    where = [*base, LogChunk.offset >= since_offset] if since_offset is not None else base
    first = session.scalar(select(func.min(LogChunk.offset)).where(*where))
    if first is None:
        return LogPage([], start, 0, False)
    # the worker keeps a log's tail only: what was asked for before it is gone
    dropped = first - start
    if tail is not None:
        lines, end = _tail(session, where, tail)
        return LogPage(lines, end, dropped, False)
    return _forward(session, base, _chunk(session, base, start=first), dropped)


def _inside(session: Session, where: list, at: int) -> tuple[int, int, str] | None:
    """The rest of the stored read that byte `at` lies inside (not at its start), as (at, its end, text from at)."""
    row = session.execute(select(LogChunk.offset, LogChunk.end, LogChunk.text).where(
        *where, LogChunk.offset < at, LogChunk.end > at).order_by(LogChunk.offset.desc()).limit(1)).first()
    if row is None:
        return None
    return at, row[1], row[2].encode()[at - row[0]:].decode("utf-8", "replace")


def _chunk(session: Session, where: list, before: int | None = None, start: int | None = None) -> tuple[int, int, str] | None:
    """One stored read: with `start`, the oldest from that offset on; else the newest before `before` (or of all)."""
    q = select(LogChunk.offset, LogChunk.end, LogChunk.text).where(*where)
    if start is not None:
        q = q.where(LogChunk.offset >= start).order_by(LogChunk.offset)
    else:
        q = q.where(*([] if before is None else [LogChunk.offset < before])).order_by(LogChunk.offset.desc())
    row = session.execute(q.limit(1)).first()
    return None if row is None else (row[0], row[1], row[2])


def _tail(session: Session, where: list, tail: int) -> tuple[list[str], int]:
    pieces: list[str] = []
    size, breaks, end, before, more = 0, 0, None, None, False
    while tail > 0:
        row = _chunk(session, where, before=before)
        if row is None:
            break
        offset, chunk_end, text = row
        end = chunk_end if end is None else end
        pieces.append(text)
        size, breaks, before = size + len(text), breaks + text.count("\n"), offset
        # a line break before the tail's first line, or the bound: enough read
        if breaks > tail or size >= ANSWER_BYTES:
            more = _chunk(session, where, before=before) is not None
            break
    if end is None:
        end = session.scalar(select(func.max(LogChunk.end)).where(*where)) or 0
    lines = "".join(reversed(pieces)).splitlines()
    if more and len(lines) > tail:
        lines = lines[1:]  # begun before what was read: only its end is here
    begun_before = more and len(lines) <= tail
    shown: list[str] = []
    size = 0
    for i, line in reversed(list(enumerate(lines[-tail:] if tail > 0 else []))):
        if i == 0 and begun_before:
            line = (f"[longrun: line cut, its start more than {ANSWER_BYTES >> 20} MiB back is not read; its last "
                    f"{min(len(line), LINE_CHARS):,} characters follow; the whole line is in the log file on the "
                    f"host] … {line[-LINE_CHARS:]}")
        else:
            line = cut_line(line)
        if shown and size + len(line) > ANSWER_BYTES:
            break
        shown.append(line)
        size += len(line)
    return shown[::-1], end


def _forward(session: Session, where: list, row: tuple[int, int, str] | None, dropped: int) -> LogPage:
    """From stored read `row` on, whole lines up to ANSWER_BYTES of text (a page may end inside a stored read, its
    next_offset the byte after its last line), or one line alone where the first is longer than that."""
    pieces: list[str] = []
    size, end, more = 0, row[0] if row else 0, False
    while row is not None:
        offset, chunk_end, text = row
        data = text.encode()  # the bytes as stored: positions in them are what the next page finds again
        if size + len(data) > ANSWER_BYTES:
            cut = data.rfind(b"\n", 0, max(0, ANSWER_BYTES - size)) + 1
            if not cut and not pieces:  # a line longer than the bound: it alone, cut when shown
                cut = data.find(b"\n") + 1 or len(data)
            if cut and offset + cut < chunk_end:
                pieces.append(data[:cut].decode())
                end, more = offset + cut, True
                break
            if pieces:
                more = True
                break
        pieces.append(text)
        size, end = size + len(data), chunk_end
        row = _chunk(session, where, start=offset + 1)
    return LogPage([cut_line(line) for line in "".join(pieces).splitlines()], end, dropped, more)
