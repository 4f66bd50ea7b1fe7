"""The `longrun` command: submit, watch and steer runs through the REST API; the server and worker processes;
the depth advisor. Sub-commands live in longrun/commands/, one module per noun."""

import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import httpx
import typer
from typer._click.exceptions import ClickException

from longrun.client import APIError, ServerUnreachable
from longrun.commands import advise, check_draft, config, export, hosts, runs, service
from longrun.commands.common import OUTPUT, Declined, GlobalOptions, print_json
from longrun.config import ConfigError, resolve
from longrun.exit_codes import ExitCode, exit_codes_help
from longrun.safe_text import clean
from longrun.specs import SpecError

HELP = f"""Run long GPU training jobs on remote machines and keep them under control.

The server: --url, else LONGRUN_URL, else `url` in the config file (`longrun config show`); the token likewise: --token, LONGRUN_API_TOKEN, `token`. Every command takes --json. Shell completion: --install-completion.

[bold]Exit codes[/bold]

{exit_codes_help()}
"""


def _version(value: bool) -> None:
    if value:
        try:
            print(f"longrun {version('longrun')}")
        except PackageNotFoundError:
            print("longrun (not installed as a package)")
        raise typer.Exit()


app = typer.Typer(name="longrun", help=HELP, rich_markup_mode="rich", no_args_is_help=True,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})


@app.callback()
def root(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option(help="The server, e.g. http://gpu-head:8080 (default: LONGRUN_URL, the "
                                            "config file, then http://127.0.0.1:8080).")] = None,
    token: Annotated[str | None, typer.Option(help="The API token (default: LONGRUN_API_TOKEN, then the config "
                                              "file). A flag shows in `ps`: prefer those two.")] = None,
    show_version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
) -> None:
    ctx.obj = GlobalOptions(url, token)


app.add_typer(runs.app)
app.add_typer(hosts.app, name="hosts")
app.add_typer(export.app)
app.add_typer(advise.app)
app.add_typer(check_draft.app)
app.add_typer(config.app, name="config")
app.add_typer(service.app)


def _fail(code: ExitCode, message: str, status_code: int | None = None) -> ExitCode:
    print(f"longrun: {clean(message, multiline=True)}", file=sys.stderr)  # the server's words, as text
    if OUTPUT.json:
        print_json({"error": message, "exit_code": int(code), "status_code": status_code})
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns 0, and raises SystemExit with any other exit code (longrun/exit_codes.py)."""
    OUTPUT.json = False
    logging.basicConfig(level=os.environ.get("LONGRUN_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = app(args=sys.argv[1:] if argv is None else argv, prog_name="longrun", standalone_mode=False)
    except ClickException as exc:
        exc.show()
        code = exc.exit_code
    except (SpecError, ConfigError) as exc:
        code = _fail(ExitCode.USAGE, str(exc))
    except ServerUnreachable as exc:
        code = _fail(ExitCode.UNREACHABLE, str(exc))
    except httpx.TransportError as exc:
        url = resolve().url
        code = _fail(ExitCode.UNREACHABLE, f"lost the server at {url}: {exc.__class__.__name__} {exc}")
    except APIError as exc:
        code = _fail(ExitCode.REFUSED, str(exc), exc.status_code)
    except Declined as exc:  # a no at a confirmation: nothing was sent
        code = _fail(ExitCode.FAILED, str(exc))
    except (KeyboardInterrupt, typer.Abort):  # Ctrl-C: nothing was sent
        code = ExitCode.INTERRUPTED
    if isinstance(code, int) and code != 0:
        raise SystemExit(int(code))
    return 0


if __name__ == "__main__":
    sys.exit(main())
