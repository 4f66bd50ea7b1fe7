"""What `longrun` exits with: scripts and CI tell a failed run from a cancelled one, a typo or a down server."""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    CANCELLED = 3
    UNREACHABLE = 4
    REFUSED = 5
    INTERRUPTED = 130


MEANINGS = {
    ExitCode.OK: "done; a command that waits on a run (watch, submit --watch, logs -f): it succeeded",
    ExitCode.FAILED: "a command that waits on a run: the run failed; any command: a no at its confirmation",
    ExitCode.USAGE: "the command line or an input file (spec, evaluation) is wrong; nothing was sent",
    ExitCode.CANCELLED: "a command that waits on a run: it was cancelled (`cancel --wait` exits 0 then)",
    ExitCode.UNREACHABLE: "the server cannot be reached (--url, LONGRUN_URL or the config file; `longrun serve`)",
    ExitCode.REFUSED: "the server refused: no such run or host, a wrong token, a state that does not allow it, "
                      "an invalid spec (its message is printed)",
    ExitCode.INTERRUPTED: "Ctrl-C; a run being watched keeps going",
}


def outcome_code(status: str) -> ExitCode:
    """The exit code of a command that waited for a run to end in `status`."""
    return {"succeeded": ExitCode.OK, "cancelled": ExitCode.CANCELLED}.get(status, ExitCode.FAILED)


def exit_codes_help() -> str:
    """The table of exit codes, as `longrun --help` and docs/guide.md show it."""
    return "\n".join(f"{int(code):>3}  {MEANINGS[code]}" for code in ExitCode)
