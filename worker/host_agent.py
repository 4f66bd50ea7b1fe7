"""The worker's client of a host: each call sends one request of worker/protocol.py to the host agent
(worker/hostside/) over a transport and reads its typed answer.

The agent travels as one zipapp built here from the package (`hostside_zipapp`: fixed timestamps, sorted entries,
so the same code is the same bytes and the same name), and runs with the host's python, so a host needs nothing
installed. The request travels on stdin, never in argv (its env values and the attempt token would show in `ps`):
stdin is the request as one JSON line, then the zipapp. The agent installs itself from it on first use, unpacked
into a directory named by its content under <workspace>/.longrun/bin, inside the same single command, so every
action stays one round trip. Unpacked, the host's python caches the agent's bytecode beside it once: run from the
zipapp, every call compiled its modules again (61 against 32 ms of CPU a probe, docs/benchmarks.md). Its answer is untrusted input: anything but one JSON object of the expected
shape, within MAX_ANSWER_BYTES, is a CommandFailed that says so; but an answer that did not come back whole (empty,
or not JSON: the agent SIGKILLed mid-answer, a stray line on its stdout) is asked again, ANSWER_TRIES times in all,
and then an AnswerLost: the run's driver keeps the run and treats the host as away (the unreachable deadline).
"""

import hashlib
import io
import json
import shlex
import zipfile
from pathlib import Path
from typing import Any

from server.layout import PYTHON_UNFIT, HostLayout
from worker.host_errors import AnswerLost, CommandFailed, HostUnreachable
from worker.hostside.files import READ_LIMIT
from worker.protocol import (
    CancelAnswer,
    CancelRequest,
    CleanAnswer,
    CleanRequest,
    GpuQuery,
    GpusAnswer,
    GpusRequest,
    GpuView,
    LaunchAnswer,
    LaunchRequest,
    ProbeAnswer,
    ProbeRequest,
    ReadFrom,
    Request,
)
from worker.transport_interface import CommandResult, Transport


def hostside_zipapp(package: Path = Path(__file__).parent / "hostside") -> bytes:
    """The agent package as one zipapp: its modules under `hostside/`, its __main__.py also at the top (what
    `python file.pyz` runs). Every entry has the same fixed time and mode, in sorted order: the bytes depend only
    on the code."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        modules = sorted(package.glob("*.py"))
        entries = [("__main__.py", package / "__main__.py")] + [(f"hostside/{m.name}", m) for m in modules]
        for name, path in entries:
            entry = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            archive.writestr(entry, path.read_bytes())
    return buffer.getvalue()


HOSTSIDE_ZIPAPP = hostside_zipapp()
# the directory the agent is unpacked into on a host (python runs its __main__.py)
HOSTSIDE_NAME = f"hostside-{hashlib.sha256(HOSTSIDE_ZIPAPP).hexdigest()[:12]}"
# ssh's own exit status when the connection failed: the host never ran the command
SSH_FAILED = 255
# the shell's exit status when the host's python cannot be run (not executable, not found): asking again cannot help
NOT_RUNNABLE = (126, 127)
PYTHON_RAISED = "Traceback (most recent call last):"
# how many times one call is sent while its answer comes back empty or unreadable (each verb may be asked again)
ANSWER_TRIES = 3
# a probe answers at most 4 MiB of metrics and 4 MiB of log, escaped into JSON: anything far larger is not ours
MAX_ANSWER_BYTES = 64 << 20
# run when the agent is not installed yet: install it from stdin (after the request line), then run it. It unpacks the
# zipapp into a staging directory and renames that into place, so a directory at the path is always whole (of two
# first calls at once, the second's rename fails and it runs the first's); run_path runs the directory's __main__.py
# with the directory first on sys.path. Given the workspace and its real path when the host was registered (argv 3
# and 4), it first checks that the directory it installs into still leads inside that: a workspace swapped for a
# symlink to / since would have it write /.longrun/bin
INSTALL_AND_RUN = (
    "import io, json, os, runpy, shutil, sys, zipfile\n"
    "path, verb = sys.argv[1], sys.argv[2]\n"
    "request, source = sys.stdin.buffer.readline(), sys.stdin.buffer.read()\n"
    "if len(sys.argv) == 5:\n"
    "    workspace, registered = sys.argv[3], sys.argv[4]\n"
    "    for where in (workspace, os.path.dirname(path)):\n"
    "        real = os.path.realpath(where)\n"
    "        if real != registered and (where == workspace or not real.startswith(registered.rstrip('/') + '/')):\n"
    "            sys.stdout.write(json.dumps({'error': 'refusing to install the host agent under %s: %s leads to %s "
    "(its symlinks followed on the host), not inside the workspace %s as registered (%s); nothing was written. Put "
    "the workspace back, or give it again (longrun hosts update HOST --workspace DIR)' % (os.path.dirname(path), "
    "where, real, workspace, registered)}) + '\\n')\n"
    "            sys.exit(2)\n"
    "umask = os.umask(0o077)\n"
    "os.makedirs(os.path.dirname(path), exist_ok=True)\n"
    "staging = path + '.%d' % os.getpid()\n"
    "zipfile.ZipFile(io.BytesIO(source)).extractall(staging)\n"
    "try:\n"
    "    os.rename(staging, path)\n"
    "except OSError:\n"
    "    shutil.rmtree(staging, ignore_errors=True)\n"
    "os.umask(umask)\n"
    "sys.argv, sys.stdin = [path, verb], io.TextIOWrapper(io.BytesIO(request), encoding='utf-8')\n"
    "runpy.run_path(path, run_name='__main__')\n"
)

# the request's field that names the workspace and its real path when the host was registered, checked by the agent
# before it writes (worker/hostside/files.py workspace_moved)
WORKSPACE_CHECK = "workspace_check"
# how the host's python runs the agent: no site hooks (-S), and UTF-8 mode (-X utf8, Python >= 3.7), so that
# paths, files and subprocess pipes are UTF-8 whatever the host's locale, LANG, LC_ALL or PYTHONUTF8 say (under
# LC_ALL=C with PYTHONUTF8=0 a python's filesystem encoding is ASCII: a workspace named in other letters could not
# be opened). The request and the answer are bytes in any case (hostside/agent.py)
AGENT_FLAGS = ("-S", "-X", "utf8")
# the workspace's real path, asked with nothing installed: one JSON line
# and the python's version: run with no flags (a python 2 refuses -X), its source valid from Python 2.7 on; the path
# resolved as bytes, so an ASCII filesystem encoding cannot change it
RESOLVE = (
    "import json, os, sys\n"
    "v = '%d.%d.%d' % tuple(sys.version_info[:3])\n"
    "answer = {'python': v, 'executable': sys.executable}\n"
    "if sys.version_info >= (3, 8):\n"
    "    answer['real'] = os.path.realpath(os.fsencode(sys.argv[1])).decode('utf-8', 'surrogateescape')\n"
    "    for name in ('subprocess', 'signal', 'zipimport', 'hashlib', 'errno', 'stat'):\n"
    "        try:\n"
    "            __import__(name)\n"
    "        except ImportError:\n"
    "            answer['missing'] = name\n"
    "sys.stdout.write(json.dumps(answer) + '\\n')\n"
)
# what each path given is on the host: "dir", "file" or None (absent, or not to be read by this user); nothing is
# opened, only stat'ed
STAT = (
    "import json, os, stat, sys\n"
    "def kind(p):\n"
    "    try:\n"
    "        mode = os.stat(os.fsencode(p)).st_mode\n"
    "    except (OSError, ValueError):\n"
    "        return None\n"
    "    return 'dir' if stat.S_ISDIR(mode) else 'file'\n"
    "sys.stdout.write(json.dumps([kind(p) for p in sys.argv[1:]]) + '\\n')\n"
)
# the oldest python the agent runs on (docs/reliability.md's host matrix runs it there)
HOST_PYTHON_FLOOR = (3, 8)


class HostAgent:
    def __init__(self, transport: Transport, workspace: str, python: str = "python3",
                 timeout: float = 120.0, registered_real: str | None = None):
        """`registered_real`: the workspace's real path as its host resolved it when the host was registered (None:
        not known yet). With it, every call is refused on the host before anything is written there when the
        workspace no longer leads there (the agent's install, `launch` and `clean`: WORKSPACE_CHECK)."""
        self.transport = transport
        self.layout = HostLayout(workspace)
        self.python = python
        self.timeout = timeout
        self.registered_real = registered_real
        self.script = f"{self.layout.bin_dir}/{HOSTSIDE_NAME}"

    def call(self, request: Request, timeout: float | None = None) -> Any:
        """Send `request`; its answer comes back as `request.answer`. Raises HostUnreachable, CommandFailed."""
        # -S: the agent needs only the standard library, and a venv's site hooks would double its start-up;
        # -X utf8 (AGENT_FLAGS): its paths, files and pipes are UTF-8 whatever the host's locale
        run = shlex.join([self.python, *AGENT_FLAGS, self.script, request.verb])
        registered = [self.layout.workspace, self.registered_real] if self.registered_real else []
        install = shlex.join([self.python, *AGENT_FLAGS, "-c", INSTALL_AND_RUN, self.script, request.verb,
                              *registered])
        command = f"if [ -f {shlex.quote(self.script + '/__main__.py')} ]; then exec {run}; else exec {install}; fi"
        wire = request.to_wire()
        if self.registered_real:
            wire[WORKSPACE_CHECK] = {"path": self.layout.workspace, "real": self.registered_real}
        payload = json.dumps(wire).encode() + b"\n" + HOSTSIDE_ZIPAPP
        for tries in range(1, ANSWER_TRIES + 1):
            result = self.transport.exec(command, stdin=payload, timeout=timeout or self.timeout)
            try:
                answer = _answer_of(request.verb, result)
                break
            except AnswerLost as exc:
                if tries == ANSWER_TRIES:
                    raise AnswerLost(f"{exc} ({ANSWER_TRIES} tries in a row)") from None
        try:
            return request.answer.from_wire(answer)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CommandFailed(f"{request.verb}: the host's answer is not of the expected shape "
                                f"({type(exc).__name__}: {exc}): {result.stdout.strip()[:200]!r}") from None

    def launch(self, request: LaunchRequest) -> LaunchAnswer:
        return self.call(request)

    def probe(self, directory: str, read_from: ReadFrom, gpu_tokens: list[str] | None = None,
              limit: int = READ_LIMIT) -> ProbeAnswer:
        """Status, new metric lines and log text (at most `limit` bytes of each); with gpu_tokens also a GPU
        snapshot, in the same round trip."""
        gpus = GpuQuery(gpu_tokens) if gpu_tokens is not None else None
        return self.call(ProbeRequest(directory, read_from.metrics_offset, read_from.log_offset, gpus,
                                      read_from.metrics_identity, read_from.log_identity, limit))

    def cancel(self, directory: str, grace: float, read_from: ReadFrom | None = None,
               gpu_tokens: list[str] | None = None) -> CancelAnswer:
        """Stop the attempt and verify; with `read_from` a last probe, with gpu_tokens a GPU snapshot once
        nothing remains, in the same round trip."""
        gpus = GpuQuery(gpu_tokens) if gpu_tokens is not None else None
        return self.call(CancelRequest(directory, grace, read_from, gpus), timeout=grace + self.timeout)

    def clean(self, path: str, keep_into: str | None = None) -> CleanAnswer:
        """Empty `path` (inside the workspace); with keep_into, move the exported draft there first."""
        return self.call(CleanRequest(self.layout.workspace, self.layout.records, path, keep_into))

    def workspace_real(self) -> str:
        """The workspace's real path on the host, its symlinks followed there: asked before the agent is installed
        under it (nothing is written there), so that one leading to / or a system directory is refused first."""
        result = self.transport.exec(shlex.join([self.python, "-c", RESOLVE, self.layout.workspace]),
                                     timeout=self.timeout)
        if result.returncode == 127 or (result.returncode != 0 and not result.stdout.strip()):
            raise PythonUnfit(f"{PYTHON_UNFIT}{self.python!r} did not run on the host (exit {result.returncode}: "
                              f"{result.stderr.strip()[-300:]}); register the host with --python naming a Python "
                              f"{_floor()} or newer")
        try:
            answer = _answer_of("workspace", result)
        except AnswerLost as exc:  # asked once, before anything is installed: a python that answers so is unfit
            raise CommandFailed(str(exc)) from None
        version = str(answer.get("python", "?"))[:32]
        if "real" not in answer:
            raise PythonUnfit(f"{PYTHON_UNFIT}the host's python {self.python!r} is Python {version}; the agent needs Python "
                              f"{_floor()} or newer: register the host with --python naming one "
                              f"(longrun hosts update NAME --python /path/to/python3)")
        if "missing" in answer:
            raise PythonUnfit(f"{PYTHON_UNFIT}the host's python {self.python!r} (Python {version}) lacks the standard module "
                              f"{str(answer['missing'])[:64]!r} the agent needs: register the host with --python "
                              "naming a complete Python")
        real = answer.get("real")
        if not isinstance(real, str) or not real.startswith("/"):
            raise CommandFailed(f"workspace: the host's answer is not a path: {result.stdout.strip()[:200]!r}")
        return real[:4096]

    def path_kinds(self, paths: list[str]) -> list[str | None]:
        """What each of `paths` is on the host ("dir", "file", or None where it is not there), in one call."""
        result = self.transport.exec(shlex.join([self.python, "-c", STAT, *paths]), timeout=self.timeout)
        try:
            kinds = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            kinds = None
        if (result.returncode != 0 or not isinstance(kinds, list) or len(kinds) != len(paths)
                or any(k not in ("dir", "file", None) for k in kinds)):
            raise CommandFailed(f"paths: the host's answer is not of the expected shape (exit {result.returncode}): "
                                f"{(result.stdout or result.stderr).strip()[:200]!r}")
        return kinds

    def gpus(self, tokens: list[str]) -> GpuView:
        answer: GpusAnswer = self.call(GpusRequest(tokens))
        return answer.view()


class PythonUnfit(CommandFailed):
    """The host's python cannot run the agent: not found there, or older than HOST_PYTHON_FLOOR."""


def _floor() -> str:
    return ".".join(map(str, HOST_PYTHON_FLOOR))


def _answer_of(verb: str, result: CommandResult) -> dict[str, Any]:
    """The host's answer: one JSON object on the last line of stdout; anything else raises. An answer that is not
    JSON at all (none, cut off, a stray line) is an AnswerLost, unless ssh failed, the python could not run, or it
    ran and raised (its traceback said, exit 1)."""
    if len(result.stdout) > MAX_ANSWER_BYTES:
        raise CommandFailed(f"{verb}: the host answered {len(result.stdout)} bytes, more than the "
                            f"{MAX_ANSWER_BYTES} an answer may hold")
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        if result.returncode == SSH_FAILED:
            raise HostUnreachable(result.stderr.strip() or "connection lost") from None
        said = (result.stderr or result.stdout).strip()[-2000:]
        if result.returncode in NOT_RUNNABLE or (result.returncode == 1 and PYTHON_RAISED in result.stderr):
            # could not run, or ran and raised (a full disk, say): the same request would meet the same fault
            raise CommandFailed(f"{verb} failed on the host (exit {result.returncode}): {said}") from None
        raise AnswerLost(f"{verb}: no readable answer from the host agent (exit {result.returncode}): "
                         f"{said!r}") from None
    if not isinstance(answer, dict):
        raise CommandFailed(f"{verb}: the host answered {type(answer).__name__}, not a JSON object: "
                            f"{result.stdout.strip()[:200]!r}")
    if "error" in answer:
        raise CommandFailed(str(answer["error"]))
    return answer
