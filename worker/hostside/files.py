"""The attempt directory's file names and the writes and reads on them: whole-or-nothing writes, a first-writer-wins
exit code that finds room on a full disk, reads from a byte offset that end at a line end."""

import os

TOKEN_VAR = "LONGRUN_ATTEMPT_TOKEN"
DIR_VAR = "LONGRUN_ATTEMPT_DIR"
LOG_FILE = "output.log"
METRICS_FILE = "metrics.jsonl"
CONTAINMENT_FILE = "containment"
EXIT_FILE = "exit_code"
# torch elastic's error file: torchrun copies there the exception its first failed rank recorded (@record)
ERROR_FILE = "error.json"
# how much of it, and of the log's end (where torchrun names that rank), a probe of a failed job hands back
FAILURE_BYTES = 16 << 10
# written at launch, so that the exit code finds room on a disk the job has filled since
EXIT_RESERVE = "exit_code.reserve"
# written by a stop before it signals: a wrapper still starting then stops the job it starts (or starts none)
STOP_FILE = "stop_requested"
# less free space than this where an attempt ended badly is named as a likely cause
LOW_SPACE = 1 << 20
# the umask hostside was started with: the job gets it back (hostside's own files are private)
CALLER_UMASK = 0o022


def write_atomic(path, text, replace=True):
    """Write `path` whole or not at all; with replace=False a file already there is kept (first writer wins)."""
    tmp = f"{path}.{os.getpid()}.tmp"  # per writer: two processes may write the same file at once
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        _publish(tmp, path, replace)
    finally:
        _remove_quietly(tmp)


def _publish(tmp, path, replace):
    if replace:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass


def _remove_quietly(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def write_exit_code(d, code):
    """The attempt's exit code, first writer wins: the wrapper when its job ends, or a stop that cut the
    launcher's teardown short (which the wrapper then sees as a SIGKILL that must not replace it)."""
    path = os.path.join(d, EXIT_FILE)
    try:
        write_atomic(path, str(code), replace=False)
    except OSError:
        # no room for a new file: the reserve's bytes are already allocated
        reserve = os.path.join(d, EXIT_RESERVE)
        with open(reserve, "r+") as f:
            f.write(str(code).ljust(8))
        _publish(reserve, path, replace=False)
        _remove_quietly(reserve)


def read_from(path, offset, limit, line_ends=b"\n\r", final=False):
    """Text from byte offset on, at most `limit` bytes, ending just after one of `line_ends`; with `final` (the
    file is complete) the last read also hands back an unterminated last line.

    A read cut short by the limit ends at a line end too, so no line is split between two reads; only a line
    longer than the limit goes through in pieces (cut at a character boundary) rather than block the stream.
    Returns (text, new_offset, more): `more` says the limit cut the read short."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
    except FileNotFoundError:
        return "", offset, False
    more = len(data) == limit
    if more or not final:
        cut = max(data.rfind(bytes([end])) for end in line_ends)
        if cut >= 0:
            data = data[: cut + 1]
        elif more:
            data = _whole_characters(data)
        else:
            data = b""
    return data.decode("utf-8", "replace"), offset + len(data), more


def _whole_characters(data):
    """`data` less a UTF-8 sequence that its end cuts in two."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # the lead byte: its sequence is whole when it is `back` bytes long
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if length <= back else data[:-back]
    return data


def tail(path, limit):
    """The last `limit` bytes of a file as text, or None when it is not there."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def space_note(d):
    """Says that the attempt's file system is full, which a job's log cannot say once it is."""
    try:
        fs = os.statvfs(d)
    except OSError:
        return None
    free = fs.f_bavail * fs.f_frsize
    return f"the file system of {d} is full ({free} bytes free)" if free < LOW_SPACE else None
