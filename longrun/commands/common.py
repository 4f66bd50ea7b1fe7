"""What every client command shares: the --json flag, the connection from flag/env/config file, and output."""

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console, RenderableType

from longrun.client import Client
from longrun.config import resolve
from longrun.safe_text import SafeConsole, clean

YesFlag = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask on a terminal.")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON (one object; a stream of them, one per line, "
                                                       "for commands that follow a run) instead of text.")]


@dataclass
class GlobalOptions:
    """The root command's --url and --token, kept in the click context for the sub-commands."""

    url: str | None = None
    token: str | None = None


@dataclass
class OutputMode:
    """Whether this invocation prints JSON: errors are then JSON too (longrun.cli.main reads it)."""

    json: bool = False


OUTPUT = OutputMode()


# what is printed holds the server's strings (run names, host fields, messages): text, never markup or emoji codes,
# and never a terminal's control sequences (SafeConsole)
PLAIN = {"highlight": False, "markup": False, "emoji": False}


def stdout() -> Console:
    # a pipe gets wide lines, not rich's 80-column default: nothing that scripts read is cut
    console = SafeConsole(soft_wrap=False, **PLAIN)
    return console if console.is_terminal else SafeConsole(width=200, **PLAIN)


def stderr() -> Console:
    return SafeConsole(stderr=True, **PLAIN)


def begin(as_json: bool) -> None:
    """Called first by each command with its --json flag."""
    OUTPUT.json = as_json


@contextmanager
def connect(ctx: typer.Context) -> Iterator[Client]:
    options: GlobalOptions = ctx.find_root().obj or GlobalOptions()
    connection = resolve(options.url, options.token)
    with Client(connection.url, connection.token) as client:
        # what the server chose for us (a name that named several ended runs: its newest) goes to stderr
        client.on_note = lambda note: stderr().print(f"longrun: note: {note}", soft_wrap=True)
        yield client


def print_json(obj: Any, lines: bool = False) -> None:
    """One JSON document, indented; with lines, compact on one line (a stream of them)."""
    text = json.dumps(obj, separators=(",", ":")) if lines else json.dumps(obj, indent=2)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def emit(obj: Any, as_json: bool, human: RenderableType | str) -> None:
    """`obj` as JSON with --json, else `human` for people."""
    if as_json:
        print_json(obj)
    else:
        stdout().print(human)


def asked(question: str, yes: bool, default: bool = True) -> bool | None:
    """The answer to `question` on a terminal; None where nobody can answer (a script, a pipe) or --yes was given."""
    if yes or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    return typer.confirm(clean(question), default=default)


def confirm(question: str, yes: bool) -> None:
    """Ask `question` when stdin and stdout are a terminal and --yes was not given; a no stops the command
    (exit 1). Scripts and pipes are not asked: they go on, as they always have."""
    if yes or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return
    # a no exits 1, as apt's and click's own aborts do; Ctrl-C at the question stays 130 (typer.Abort)
    if not typer.confirm(clean(question)):
        raise Declined("not confirmed: nothing was done (--yes skips the question)")


class Declined(Exception):
    """A no at a confirmation: the command did nothing and exits 1."""
