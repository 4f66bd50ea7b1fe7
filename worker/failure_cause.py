"""Why a job failed, in one line: the exception its first failed rank recorded in torch elastic's error file
(the trainer's main is wrapped in torch's `@record`; the host agent points TORCHELASTIC_ERROR_FILE into the
attempt's directory, and torchrun copies the root cause there), and that rank, from torchrun's failure summary at
the log's end. Everything here comes from the host: it is parsed, bounded, and never trusted as markup."""

import json
import re

# torchrun's summary: "Root Cause (first observed failure):" ... "  rank      : 1 (local_rank: 1)"
_ROOT_RANK = re.compile(r"Root Cause \(first observed failure\):.*?\brank\s*:\s*(\d+)", re.S)
MAX_CHARS = 500


def cause(failure: dict | None) -> str | None:
    """'rank 1 raised FileNotFoundError: [Errno 2] ...', or None when the job recorded no exception."""
    if not failure:
        return None
    message = _recorded(failure.get("error_file"))
    if message is None:
        return None
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


def _clip(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 1] + "…"
