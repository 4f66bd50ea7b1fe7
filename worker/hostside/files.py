"""The attempt directory's file names and the writes and reads on them: whole-or-nothing writes, a first-writer-wins
exit code that finds room on a full disk, reads from a byte offset that end at a line end and notice a file written
anew since the last."""

import hashlib
import os
import time

TOKEN_VAR = "LONGRUN_ATTEMPT_TOKEN"
DIR_VAR = "LONGRUN_ATTEMPT_DIR"
LOG_FILE = "output.log"
METRICS_FILE = "metrics.jsonl"
CONTAINMENT_FILE = "containment"
EXIT_FILE = "exit_code"
# the wrapper's clock when it started the job and when the job ended (seconds since the epoch): the attempt's
# duration is taken from them, not from when the worker saw it start or end
STARTED_FILE = "started_at"
ENDED_FILE = "ended_at"
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
# a file's identity, kept with the offset read to: its inode and digests of its first bytes and of those just before
# the offset (up to this many each); a file shorter than the offset, or whose bytes there differ, was written anew
FINGERPRINT_BYTES = 4096
# the most a probe reads of each file at once (its answer escapes it into JSON: worker/host_agent.py bounds that)
READ_LIMIT = 4 << 20
# what the server keeps of each node's log, its last bytes (worker/ingest.py MAX_STORED_LOG_BYTES; a test holds the two
# in step): a read of a job that has ended skips what lies before them
LOG_KEPT_BYTES = 64 << 20
# the umask hostside was started with: the job gets it back (hostside's own files are private)
CALLER_UMASK = 0o022


def workspace_moved(req, *paths):
    """Why nothing may be written for `req`: its workspace no longer leads to its real path when the host was
    registered (`workspace_check`, which worker/host_agent.py adds to every request once it knows it), or one of
    `paths` leads outside it, their symlinks followed now; None when both hold, or nothing was registered."""
    check = req.get("workspace_check")
    if not isinstance(check, dict) or not isinstance(check.get("path"), str) or not isinstance(check.get("real"), str):
        return None
    workspace, registered = check["path"], check["real"]
    for path in (workspace,) + paths:
        real = os.path.realpath(path)
        if real != registered and (path == workspace or not real.startswith(registered.rstrip("/") + "/")):
            return (f"refusing to write under {path}: it leads to {real} (its symlinks followed on the host), not "
                    f"inside the workspace {workspace} as registered ({registered}); nothing was written. Put the "
                    "workspace back, or give it again (longrun hosts update HOST --workspace DIR)")
    return None


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


def write_time(d, name):
    """Now, by this host's clock, into `name`; a full disk leaves it out (the worker then goes by its own)."""
    try:
        write_atomic(os.path.join(d, name), repr(time.time()))
    except OSError:
        pass


def read_time(d, name):
    try:
        return float(read(os.path.join(d, name)) or "")
    except ValueError:
        return None


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


def read_from(path, offset, limit, line_ends=b"\n\r", final=False, identity=None, keep=None):
    """Text from byte offset on, at most `limit` bytes, ending just after one of `line_ends`; with `final` (the
    file is complete) the last read also hands back an unterminated last line. With `keep`, a file whose unread
    part is longer is read from the start of the first line in its last `keep` bytes: what lies before would be
    dropped once read (the server keeps a log's tail), and reading it would only hold the outcome back.

    A read cut short by the limit ends at a line end too, so no line is split between two reads; only a line
    longer than the limit goes through in pieces (cut at a character boundary) rather than block the stream.

    `identity` is what the last read answered: a file the job truncated below `offset` ("truncated"), or wrote
    anew whatever its length (other bytes where the last read's were: "rewritten", or "replaced" on another
    inode), is read again from its start. Returns (text, new_offset, more, identity, change, skipped): `more` says
    the limit cut the read short, `change` is None or how the file was written anew, `skipped` how many bytes from
    the offset (0 after a change) were passed over to reach the last `keep`."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return "", 0, False, None, "truncated" if offset > 0 else None, 0
    with f:
        inode = os.fstat(f.fileno()).st_ino
        change = _change(f, inode, offset, identity)
        if change is not None:
            offset = 0
        skipped = _skip(f, offset, keep, line_ends, limit) if keep is not None else 0
        offset += skipped
        f.seek(offset)
        data = f.read(limit)
        more = len(data) == limit
        if more or not final:
            cut = max(data.rfind(bytes([end])) for end in line_ends)
            if cut >= 0:
                data = data[: cut + 1]
            elif more:
                data = _whole_characters(data)
            else:
                data = b""
        end = offset + len(data)
        head, tail = _fingerprints(f, end)
    return data.decode("utf-8", "replace"), end, more, {"inode": inode, "head": head, "tail": tail}, change, skipped


def _skip(f, offset, keep, line_ends, limit):
    """How many bytes from `offset` to pass over so that what is left is within the file's last `keep` bytes and
    starts a line: just after the first line end at or after that point's last byte before, within `limit` bytes
    (else at the point itself, inside a line longer than that)."""
    start = os.fstat(f.fileno()).st_size - keep
    if start <= offset:
        return 0
    f.seek(start - 1)
    window = f.read(limit)
    ends = [i for i in (window.find(bytes([end])) for end in line_ends) if i >= 0]
    return (start + min(ends) if ends else start) - offset


def _fingerprints(f, offset):
    """Digests of the file's first bytes and of those just before `offset`, up to FINGERPRINT_BYTES each."""
    def digest(start, end):
        f.seek(start)
        return hashlib.sha256(f.read(end - start)).hexdigest()[:32]

    return digest(0, min(offset, FINGERPRINT_BYTES)), digest(max(0, offset - FINGERPRINT_BYTES), offset)


def _change(f, inode, offset, identity):
    """How the file differs from what the last read to `offset` saw (its `identity`), or None: the same bytes
    there, though perhaps on another inode (a copy renamed over it holds nothing new to read again)."""
    size = os.fstat(f.fileno()).st_size
    if size < offset:
        return "truncated"
    if not isinstance(identity, dict):
        return None
    if _fingerprints(f, offset) == (identity.get("head"), identity.get("tail")):
        return None
    return "rewritten" if identity.get("inode") == inode else "replaced"


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
