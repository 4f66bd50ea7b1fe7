"""The verb dispatch: `VERB` in argv, its request one JSON object on stdin, its answer one JSON line on stdout.

Binary-safe by construction: the request is read as bytes from `sys.stdin.buffer` (the line before the zipapp that
`HostAgent.call` sends after it) and decoded as UTF-8 here, and the answer is written as ASCII bytes (json.dumps
escapes everything else) to `sys.stdout.buffer`. Nothing depends on the host's locale, LANG, LC_*,
PYTHONIOENCODING or PYTHONUTF8: a text-mode stdin would decode the zipapp's bytes with the locale's codec
(strict UTF-8 under en_US.UTF-8) and fail before the request is read."""

import json
import os
import sys

from . import files
from .attempt import cancel, probe
from .clean import clean
from .gpus import gpus, interconnect
from .launch import launch, wrap
from .verifier import verifier

VERBS = {"launch": launch, "probe": probe, "cancel": cancel, "clean": clean, "gpus": gpus,
         "interconnect": interconnect, "verifier": verifier}
# a request is a few KiB (a launch's argv and env); anything far larger is not ours
MAX_REQUEST_BYTES = 16 << 20


def read_request(stream):
    """The request: the first line of the byte stream `stream`, a JSON object in UTF-8; else a ValueError saying
    what it was."""
    line = stream.readline(MAX_REQUEST_BYTES + 1)
    if len(line) > MAX_REQUEST_BYTES:
        raise ValueError(f"the request is longer than {MAX_REQUEST_BYTES} bytes")
    try:
        request = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"the request is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise ValueError(f"the request is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise ValueError(f"the request is a JSON {type(request).__name__}, not an object")
    return request


def answer(result, out=None):
    """Write `result` as one JSON line of ASCII bytes."""
    out = out or sys.stdout.buffer
    out.write(json.dumps(result, ensure_ascii=True).encode("ascii") + b"\n")
    out.flush()


def main(argv, stdin=None):
    # the attempt's files hold its token and env: private to this user
    files.CALLER_UMASK = os.umask(0o077)
    if len(argv) == 3 and argv[0] == "wrap":
        wrap(argv[1], argv[2])
        return 0
    if len(argv) != 1 or argv[0] not in VERBS:
        answer({"error": f"usage: hostside-<sha> {'|'.join(VERBS)} < JSON"})
        return 2
    try:
        request = read_request(stdin or sys.stdin.buffer)
    except ValueError as exc:
        answer({"error": f"{argv[0]}: the request on stdin is not a JSON object: {exc}"})
        return 2
    result = VERBS[argv[0]](request)
    answer(result)
    return 2 if "error" in result else 0
