"""The long-lived processes: `serve` (API, web page and, by default, the worker), `worker`, `migrate`."""

import json
import logging
import os
import re
from typing import Annotated, Any

import typer

from longrun.commands.common import begin, emit
from longrun.exit_codes import ExitCode

app = typer.Typer()

JsonLogs = Annotated[bool, typer.Option("--json", help="Log one JSON object per line (time, level, logger, "
                                                       "message) for a log collector.")]


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


# what may end a line on a terminal or in a log reader: C0 controls but the tab, DEL, C1, the Unicode separators
LINE_BREAKING = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\x1b": "\\x1b"}


def one_line(text: str) -> str:
    """`text` with its control characters escaped: a host's field or a job's words cannot start a log line."""
    return LINE_BREAKING.sub(lambda m: _ESCAPES.get(m[0]) or f"\\u{ord(m[0]):04x}", text)


class PlainLineFormatter(logging.Formatter):
    """One line per record, whatever the stored or host strings in its message; a traceback follows indented, so
    that no line of it reads as a record of its own."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802  (logging's name)
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:  # noqa: N802
        return "\n".join("    " + one_line(line) for line in super().formatException(ei).split("\n"))

    def formatStack(self, stack_info: str) -> str:  # noqa: N802
        return "\n".join("    " + one_line(line) for line in stack_info.split("\n"))


def configure_logging(as_json: bool) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLineFormatter() if as_json else PlainLineFormatter())
    level = os.environ.get("LONGRUN_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if level.upper() != "DEBUG":
        # alembic lists each plugin it sets up at INFO, a dozen lines before the one that says where to go
        logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on (default LONGRUN_BIND_HOST, 127.0.0.1); "
                                             "anything but loopback needs LONGRUN_API_TOKEN.")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default LONGRUN_PORT, 8080).", min=1, max=65535)] = None,
    no_worker: Annotated[bool, typer.Option("--no-worker", help="API only; run `longrun worker` separately.")] = False,
    as_json: JsonLogs = False,
) -> int:
    """The API server and web page, with the worker embedded unless --no-worker."""
    configure_logging(as_json)  # first: importing the database layer logs already
    from longrun.processes import serve as serve_forever

    serve_forever(host, port, with_worker=not no_worker)
    return ExitCode.OK


@app.command()
def worker(as_json: JsonLogs = False) -> int:
    """The worker loop alone (several may share one database)."""
    configure_logging(as_json)
    from longrun.processes import work

    work()
    return ExitCode.OK


@app.command()
def migrate(as_json: Annotated[bool, typer.Option("--json", help="Print the database and its state as "
                                                               "JSON.")] = False) -> int:
    """Create or upgrade the database schema."""
    from sqlalchemy.engine import make_url

    from longrun.processes import open_database

    begin(as_json)
    settings, _ = open_database()
    # the URL may hold the database's password: logs (the compose migration job's) must not
    url = make_url(settings.resolved_database_url).render_as_string(hide_password=True)
    emit({"database": url, "up_to_date": True}, as_json, f"database at {url} is up to date")
    return ExitCode.OK
