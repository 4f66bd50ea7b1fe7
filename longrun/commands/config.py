"""`longrun config`: the server the command talks to, from the config file, the environment or flags."""

from typing import Annotated

import typer

from longrun.commands.common import GlobalOptions, JsonFlag, begin, emit
from longrun.config import KEYS, config_path, resolve, write_setting
from longrun.exit_codes import ExitCode

app = typer.Typer(help="The URL and token the command uses: flag > LONGRUN_URL / LONGRUN_API_TOKEN > the "
                       "config file (~/.config/longrun/config.toml, or $LONGRUN_CONFIG).")

Key = Annotated[str, typer.Argument(help=f"The setting: {' or '.join(KEYS)}.")]


@app.command()
def show(ctx: typer.Context, as_json: JsonFlag = False) -> int:
    """The URL and token in use and where each comes from (the token masked)."""
    begin(as_json)
    options: GlobalOptions = ctx.find_root().obj or GlobalOptions()
    connection = resolve(options.url, options.token)
    shown = {"url": connection.url, "url_from": connection.url_from,
             "token": "***" if connection.token else None, "token_from": connection.token_from,
             "config_file": str(config_path())}
    emit(shown, as_json, "\n".join(f"{k}: {'-' if v is None else v}" for k, v in shown.items()))
    return ExitCode.OK


@app.command("set")
def set_value(key: Key, value: Annotated[str, typer.Argument(help="Its value.")], as_json: JsonFlag = False) -> int:
    """Write a setting to the config file (created readable by you only)."""
    begin(as_json)
    path = config_path()
    write_setting(path, key, value)
    emit({"config_file": str(path), "key": key}, as_json, f"{key} set in {path}")
    return ExitCode.OK


@app.command()
def unset(key: Key, as_json: JsonFlag = False) -> int:
    """Remove a setting from the config file."""
    begin(as_json)
    path = config_path()
    write_setting(path, key, None)
    emit({"config_file": str(path), "key": key}, as_json, f"{key} removed from {path}")
    return ExitCode.OK
