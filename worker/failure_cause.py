"""Why a job failed, in one line: the exception its first failed rank recorded in torch elastic's error file
(the trainer's main is wrapped in torch's `@record`; the host agent points TORCHELASTIC_ERROR_FILE into the
attempt's directory, and torchrun copies the root cause there), and that rank, from torchrun's failure summary at
the log's end. Everything here comes from the host: it is parsed, bounded, and never trusted as markup.

A script whose main is not wrapped in `@record` leaves no error file: then the failing rank's last traceback lines
are read from the log's end (server/tracebacks.py finds the rank's own lines, or the last traceback before
torchrun's summary; a job of one process, started without torchrun, has no summary and its last traceback is its
own), and the cause says they came from the log and where the whole traceback is."""

import json
import re

from server import tracebacks

# torchrun's summary: "Root Cause (first observed failure):" ... "  rank      : 1 (local_rank: 1)"
_ROOT_RANK = re.compile(r"Root Cause \(first observed failure\):.*?\brank\s*:\s*(\d+)", re.S)
MAX_CHARS = 500
# a traceback's frame line: File "train.py", line 12, in main
_FRAME = re.compile(r'^File "(.*)", line (\d+), in (.*)$')


def cause(failure: dict | None, run: str = "RUN") -> str | None:
    """'rank 1 raised FileNotFoundError: [Errno 2] ...', or None when neither the job's error file nor its log's
    end holds an exception. `run` names the run in the command that shows the whole traceback."""
    if not failure:
        return None
    message = _recorded(failure.get("error_file"))
    if message is None:
        return _from_log(failure.get("log_tail") or "", run)
    rank = _ROOT_RANK.search(failure.get("log_tail") or "")
    who = f"rank {rank.group(1)}" if rank else "a rank"
    return f"{who} raised {_clip(message)}"


def traceback_of(error_file: str | None) -> str | None:
    """The recorded traceback (py_callstack), as the failed rank printed it."""
    extra = (_message(error_file) or {}).get("extraInfo")
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    return stack if isinstance(stack, str) else None


def _message(error_file: str | None) -> dict | None:
    try:
        body = json.loads(error_file) if error_file else None
    except ValueError:  # cut short, or not torch's
        return None
    message = body.get("message") if isinstance(body, dict) else None
    return message if isinstance(message, dict) else None


def _recorded(error_file: str | None) -> str | None:
    text = (_message(error_file) or {}).get("message")
    return text if isinstance(text, str) and text.strip() else None


def _clip(text: str, most: int = MAX_CHARS) -> str:
    line = " ".join(text.split())
    return line if len(line) <= most else line[: most - 1] + "…"


def _from_log(log: str, run: str) -> str | None:
    """The failing rank's exception and the frame that raised it, from the log's end (no @record)."""
    failures = tracebacks.parse_summary(log)
    root = next((f for f in failures if f.root_cause), None)
    if root is not None:
        if not root.traceback.startswith(tracebacks.PLACEHOLDER):
            return None  # a signal, or what torchrun itself says: not an exception of the script
        found = tracebacks.traceback_in_log(log, root)
        trace = found[0] if found else None
        who, how = f"rank {root.rank}", f"wrap main in @record for torchrun to record it; `longrun logs {run} --rank {root.rank}`"
    else:  # one process without torchrun: its own last traceback
        trace = tracebacks.last_traceback(log.splitlines())
        who, how = "the job", f"`longrun logs {run}`"
    if trace is None:
        return None
    lines = [line.strip() for line in trace.splitlines() if line.strip()]
    exception, frames = lines[-1], lines[1:-1]
    at = [i for i, line in enumerate(frames) if _FRAME.match(line)]
    where = ""
    if at:
        path, number, function = _FRAME.match(frames[at[-1]]).groups()
        code = frames[at[-1] + 1] if at[-1] + 1 < len(frames) and not _FRAME.match(frames[at[-1] + 1]) else ""
        where = f" at {path}:{number} in {function}" + (f": {code}" if code else "")
    note = f" [from its log: {how} has the whole traceback]"
    return _clip(f"{who} raised {exception}{where}", MAX_CHARS - len(note)) + note
