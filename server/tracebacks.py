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
only its last summary is read, and the text is returned as data, never as markup.

A rank of a script whose main is not `@record`ed leaves no error file, and its summary's traceback is torch's
placeholder ("To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"), while the real
traceback went to the log before the summary. longrun's launch (worker/jobs.py job_argv) passes neither `--tee`
nor `--log-line-prefix-template`, so a rank's lines carry a prefix only where torch adds one: a rank that has
joined a process group prints its uncaught exception with `[rankN]: ` before each line (torch 2.13's
distributed_c10d excepthook), `--tee` in a user's own torchrun gives `[defaultL]:` (the local rank; elastic
multiprocessing/tail_log.py), and a template such as `[${rank}]:` gives `[N]:`. That rank's last traceback is
shown from those lines; else the last `Traceback (most recent call last):` block before torchrun's own, which
the answer says may be another rank's when several raised. Either way the answer says where it came from and
how to get the file (`@record`)."""

import re
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.errors import NotFound
from server.models import LogChunk, Run

ROOT_CAUSE = "Root Cause (first observed failure):"
_BLOCK = re.compile(r"^\[\d+\]:$")
_FIELD = re.compile(r"^  (time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")
_RANK = re.compile(r"^(\d+)(?: \(local_rank: (\d+)\))?")
PLACEHOLDER = "To enable traceback see:"  # torch elastic's summary line for a rank that recorded no error file
TRACEBACK_START = "Traceback (most recent call last):"
LAUNCHER_FAILURE = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
# a line's rank prefix: torch's excepthook `[rank1]: `, --tee's `[default1]:` (local rank), a template's `[1]:`
_PREFIX = re.compile(r"^\[(rank|default|)(\d{1,6})\]: ?")
RECORD_HINT = ("to have torchrun record it: wrap the script's main in torch elastic's @record "
               "(from torch.distributed.elastic.multiprocessing.errors import record), as the bundled trainer's is")
# how much of a node's log, from its end, is searched for the summary (it is torchrun's last words)
SEARCH_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class RankFailure:
    rank: int
    traceback: str
    root_cause: bool  # torchrun's first observed failure
    local_rank: int | None = None


def parse_summary(text: str) -> list[RankFailure]:
    """The failed ranks of the last failure summary in `text` (none when there is none)."""
    root = text.rfind(ROOT_CAUSE)
    if root < 0:
        return []
    start = text.rfind("\nFailures:\n", 0, root)
    failures: list[RankFailure] = []
    rank: int | None = None
    local_rank: int | None = None
    trace: list[str] | None = None
    in_root = False

    def close() -> None:
        if rank is not None and trace is not None:
            failures.append(RankFailure(rank, "\n".join(trace).rstrip(), in_root, local_rank))

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
            local_rank = int(number.group(2)) if number.group(2) else None
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
        text = _log_end(session, run.id, number, node)
        failures = parse_summary(text)
        for failure in failures:
            if failure.rank == rank:
                return number, node, from_log_if_unrecorded(text, failure, failures, node)
        seen += [f.rank for f in failures]
    if not seen:
        raise NotFound(f"attempt {number} of run {run.id} has no failure summary of torchrun in its log "
                       f"(it is {att.status}): no rank has failed in it")
    ranks = ", ".join(str(r) for r in sorted(set(seen)))
    raise NotFound(f"rank {rank} did not fail in attempt {number} of run {run.id}; failed: rank {ranks}")


def _summary_start(text: str) -> int:
    """Where torchrun's last failure summary begins, its own traceback (ChildFailedError) included."""
    root = text.rfind(ROOT_CAUSE)
    failures = text.rfind("\nFailures:\n", 0, root)
    end = failures if failures >= 0 else root
    launcher = text.rfind(LAUNCHER_FAILURE, max(0, end - 16384), end)  # torchrun's traceback, just before
    if launcher >= 0:
        own = text.rfind(TRACEBACK_START, 0, launcher)
        return own if own >= 0 else launcher
    return end


def last_traceback(lines: list[str]) -> str | None:
    """The last `Traceback (most recent call last):` block in `lines`: its frames (indented) and the exception line."""
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACEBACK_START)]
    for start in reversed(starts):
        block = [lines[start]]
        for line in lines[start + 1 :]:
            block.append(line)
            if line and not line.startswith((" ", "\t")):
                break  # the exception line ends the block
        if not block[-1].startswith(LAUNCHER_FAILURE):
            return "\n".join(block).rstrip()
    return None


def traceback_in_log(text: str, failure: RankFailure) -> tuple[str, str] | None:
    """(the rank's last traceback before torchrun's summary, where it came from), or None when the log has none.

    Lines prefixed for this rank (`[rankN]: `, `[N]:`, or `--tee`'s `[defaultL]:` with its local rank) are read
    first; a log without rank prefixes gives its last traceback."""
    lines = text[: _summary_start(text)].splitlines()
    own: list[str] = []
    prefixed = False
    for line in lines:
        prefix = _PREFIX.match(line)
        if prefix is None:
            continue
        prefixed = True
        kind, number = prefix.group(1), int(prefix.group(2))
        if (number == failure.local_rank) if kind == "default" else (number == failure.rank):
            own.append(line[prefix.end() :])
    trace = last_traceback(own)
    if trace is not None:
        return trace, "its own lines, by their rank prefix"
    trace = last_traceback([line for line in lines if not _PREFIX.match(line)])
    if trace is None:
        return None
    how = "the last traceback before torchrun's summary; its lines carry no rank"
    return trace, how + (", and other ranks' lines do, so it may be no rank's" if prefixed else "")


def from_log_if_unrecorded(text: str, failure: RankFailure, failures: list[RankFailure], node: int) -> RankFailure:
    """`failure` as it is when the rank recorded its traceback; else its traceback found in the node's log, saying
    where it came from and how to have it recorded (the summary shows only torch's placeholder link)."""
    if not failure.traceback.startswith(PLACEHOLDER):
        return failure
    found = traceback_in_log(text, failure)
    if found is None:
        note = (f"rank {failure.rank} recorded no error file (torchrun's summary: {failure.traceback!r}), and node "
                f"{node}'s log holds no traceback before the summary (an exit without an exception, or a crash in "
                f"native code: see `longrun logs`)\n{RECORD_HINT}")
        return replace(failure, traceback=note)
    trace, how = found
    unrecorded = [f.rank for f in failures if f.traceback.startswith(PLACEHOLDER)]
    others = [r for r in unrecorded if r != failure.rank]
    if others and "rank prefix" not in how:
        how += f"; ranks {', '.join(map(str, others))} raised too, so it may be theirs"
    head = f"(rank {failure.rank} recorded no error file; from node {node}'s log: {how})"
    return replace(failure, traceback=f"{head}\n{trace}\n({RECORD_HINT})")


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
