"""Each failed rank's traceback, from the failure summary torchrun prints at the end of a node's log.

For every rank that failed, torchrun's summary holds a block

    [0]:
      time      : 2026-12-03_06:28:09
      host      : gpu-box
      rank      : 1 (local_rank: 1)
      exitcode  : 1 (pid: 24620)
      error_file: /tmp/torchelastic_.../attempt_0/1/error.json
      traceback : Traceback (most recent call last):
        File ...
      FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-00001.bin'

where `traceback` is what the rank recorded in torch elastic's error file (its `@record`ed exception, the bundled
trainer's main is wrapped so), each further line indented by two spaces; a rank that recorded nothing reads
"Signal 15 (SIGTERM) received by PID ..." or torch's hint to use @record. Each node's torchrun lists its own
ranks (by global rank), so a multi-node attempt's ranks are in its nodes' logs. The log is the job's output:
only its last summary is read, and the text is returned as data, never as markup."""

import re
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.errors import NotFound
from server.models import LogChunk, Run

ROOT_CAUSE = "Root Cause (first observed failure):"
_BLOCK = re.compile(r"^\[\d+\]:$")
_FIELD = re.compile(r"^  (time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")
_RANK = re.compile(r"^(\d+)")
# how much of a node's log, from its end, is searched for the summary (it is torchrun's last words)
SEARCH_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class RankFailure:
    rank: int
    traceback: str
    root_cause: bool  # torchrun's first observed failure


def parse_summary(text: str) -> list[RankFailure]:
    """The failed ranks of the last failure summary in `text` (none when there is none)."""
    root = text.rfind(ROOT_CAUSE)
    if root < 0:
        return []
    start = text.rfind("\nFailures:\n", 0, root)
    failures: list[RankFailure] = []
    rank: int | None = None
    trace: list[str] | None = None
    in_root = False

    def close() -> None:
        if rank is not None and trace is not None:
            failures.append(RankFailure(rank, "\n".join(trace).rstrip(), in_root))

    for line in text[start if start >= 0 else root:].splitlines():
        if trace is not None and line.startswith("  "):
            trace.append(line[2:])  # the rest of the traceback: each line indented by two
            continue
        if _BLOCK.match(line) or line.startswith(ROOT_CAUSE) or line.startswith(("---", "===")):
            close()
            rank, trace = None, None
            in_root = in_root or line.startswith(ROOT_CAUSE)
            continue
        field = _FIELD.match(line)
        if field is None:
            continue
        if field.group(1) == "rank" and (number := _RANK.match(field.group(2))):
            rank = int(number.group(1))
        elif field.group(1) == "traceback":
            trace = [field.group(2)]
    close()
    return failures


def rank_traceback(session: Session, run: Run, attempt: int | None, rank: int) -> tuple[int, int, RankFailure]:
    """(attempt, node, failure) of `rank` in the run's current (or a given) attempt; NotFound says which ranks
    did fail when this one is not among them."""
    number = attempt or run.attempt
    att = next((a for a in run.attempts if a.number == number), None)
    if att is None:
        raise NotFound(f"run {run.id} has no attempt {number}")
    seen: list[int] = []
    nodes = session.scalars(select(LogChunk.node).where(LogChunk.run_id == run.id, LogChunk.attempt == number)
                            .distinct().order_by(LogChunk.node))
    for node in list(nodes):
        failures = parse_summary(_log_end(session, run.id, number, node))
        for failure in failures:
            if failure.rank == rank:
                return number, node, failure
        seen += [f.rank for f in failures]
    if not seen:
        raise NotFound(f"attempt {number} of run {run.id} has no failure summary of torchrun in its log "
                       f"(it is {att.status}): no rank has failed in it")
    ranks = ", ".join(str(r) for r in sorted(set(seen)))
    raise NotFound(f"rank {rank} did not fail in attempt {number} of run {run.id}; failed: rank {ranks}")


def _log_end(session: Session, run_id: str, attempt: int, node: int) -> str:
    """The last SEARCH_BYTES (about) of a node's stored log."""
    chunks = session.scalars(select(LogChunk).where(LogChunk.run_id == run_id, LogChunk.attempt == attempt,
                                                    LogChunk.node == node).order_by(LogChunk.offset.desc()))
    kept: list[str] = []
    size = 0
    for chunk in chunks:
        kept.append(chunk.text)
        size += len(chunk.text)
        if size >= SEARCH_BYTES:
            break
    return "".join(reversed(kept))
