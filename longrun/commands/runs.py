"""Runs: submit, status, watch, logs, cancel, restart (mounted at the top level: `longrun submit ...`)."""

import sys
import time
from enum import StrEnum
from typing import Annotated, Any

import httpx
import typer
from rich.console import Group
from rich.live import Live
from rich.text import Text

from longrun.client import TERMINAL, Client, LongrunError
from longrun.commands.common import (
    JsonFlag,
    YesFlag,
    asked,
    begin,
    confirm,
    connect,
    emit,
    print_json,
    stderr,
    stdout,
)
from longrun.config import ConfigError, resolve
from longrun.exit_codes import ExitCode, outcome_code
from longrun.safe_text import clean, safe
from longrun.specs import parse_assignments, read_spec, resolve_paths
from longrun.views import attempts_table, duration, progress_line, run_panel, runs_table

app = typer.Typer()


def complete_run_id(incomplete: str) -> list[tuple[str, str]]:
    """The newest runs whose id starts with what was typed, for shell completion; none when the server is away."""
    try:
        connection = resolve()
        with Client(connection.url, connection.token, timeout=5) as client:
            runs = client.list(limit=100)["items"]
    except (LongrunError, ConfigError, httpx.HTTPError):
        return []
    return [(r["id"], clean(f"{r['name']} ({r['status']})")) for r in runs if r["id"].startswith(incomplete)] + [
        (r["name"], f"{r['id']} ({r['status']})") for r in runs
        if r["name"].startswith(incomplete) and clean(r["name"]) == r["name"]]


RunId = Annotated[str, typer.Argument(help="The run's id, a unique prefix of it, or its name: its live run, "
                                      "else its newest ended one (`longrun status` lists them).",
                                      autocompletion=complete_run_id)]


class Start(StrEnum):
    """Where a restart's new attempt starts (`restart --start`): the one way to say it."""

    FRESH = "fresh"
    RESUME = "resume"
    WARM = "warm"


class SubmitStart(StrEnum):
    """Where a submitted trainer run starts over another run's checkpoint (`submit --start`)."""

    FRESH = "fresh"
    RESUME = "resume"


def start_flags(start: Start | None, clean: bool, resume: bool, init_from_last: bool) -> tuple[bool, bool, bool]:
    """(clean, resume, init_from_last) of the API's restart, from --start or its older spellings (one of them)."""
    aliases = [s for s, given in ((Start.FRESH, clean), (Start.RESUME, resume)) if given]
    if init_from_last:
        aliases.append(Start.WARM)
    if start is not None:
        aliases = [start, *[a for a in aliases if a != start]]
    if len(aliases) > 1:
        raise typer.BadParameter(f"say one start: {' or '.join(a.value for a in aliases)}", param_hint="--start")
    if not aliases:
        return clean, resume, init_from_last
    chosen = aliases[0]
    # a warm start trains from step 0 (clean), from the draft the last attempt exported (kept aside first)
    return chosen in (Start.FRESH, Start.WARM), chosen == Start.RESUME, chosen == Start.WARM


Interval = Annotated[float, typer.Option(help="Seconds between looks at the run.", min=0.05)]
Every = Annotated[float, typer.Option(help="Seconds between progress lines when the output is not a terminal.",
                                      min=0)]


def _reconnecting(message: str) -> None:
    stderr().print(Text(message))


# the states in which a run has an attempt that a cancel or restart would stop
LIVE = frozenset({"launching", "running"})


def _flat(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec's fields, the trainer's by their own names (as restart overrides name them)."""
    fields = dict(spec)
    trainer = fields.pop("trainer", None) or {}
    return {**fields, **trainer}


def spec_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'ttt_steps: 3 -> 5' per changed field, in the order the new spec has them."""
    before, after = _flat(old), _flat(new)
    return [f"{k}: {before.get(k, '(unset)')} -> {after.get(k, '(unset)')}"
            for k in [*after, *(k for k in before if k not in after)] if before.get(k) != after.get(k)]


def follow_run(client: Client, run_id: str, interval: float, every: float, as_json: bool) -> ExitCode:
    """Show the run until it ends: a live panel on a terminal, lines on a pipe, JSON lines with --json;
    the exit code says how it ended, also when the server restarted meanwhile (the stream is resumed).
    Ctrl-C stops watching, not the run."""
    # a name is resolved once: a run of that name submitted meanwhile is not followed in its place
    run_id = client.get(run_id)["id"]
    try:
        if as_json:
            last: dict[str, Any] | None = None
            for run in client.watch(run_id, interval=interval, on_reconnect=_reconnecting):
                if run != last:
                    print_json(run, lines=True)
                last = run
        elif stdout().is_terminal:
            console = stdout()
            with Live(console=console, auto_refresh=False) as live:  # drawn once per look at the run
                for run in client.watch(run_id, interval=interval, on_reconnect=_reconnecting):
                    live.update(run_panel(run, min(console.width, 120)), refresh=True)
        else:
            run = _print_lines(client, run_id, interval, every)
    except KeyboardInterrupt:
        stderr().print(f"stopped watching; run {run_id} goes on (`longrun cancel {run_id}` stops it)")
        return ExitCode.INTERRUPTED
    return outcome_code(run["status"])


def _print_lines(client: Client, run_id: str, interval: float, every: float) -> dict[str, Any]:
    """A line per state change and a progress line every `every` seconds, for logs and pipes."""
    last_state, last_print = None, 0.0
    for run in client.watch(run_id, interval=interval, on_reconnect=_reconnecting):
        state = (run["status"], run["attempt"])
        if state != last_state:
            print(clean(f"{run['name']} [{run['id']}]: {run['status']} (attempt {run['attempt']})"
                        + (f" - {run['message']}" if run.get("message") else "")), flush=True)
            last_state = state
        if time.time() - last_print >= every:
            print(progress_line(run), flush=True)
            last_print = time.time()
    print(progress_line(run), flush=True)
    return run


@app.command()
def submit(
    ctx: typer.Context,
    spec_file: Annotated[str, typer.Argument(metavar="SPEC", help="The run spec: a YAML or JSON file, or - for "
                                             "standard input (fields as in docs/api.md).")],
    idempotency_key: Annotated[str | None, typer.Option(help="Submitting again with the same key and spec returns "
                                                        "the run submitted first instead of a second run.")] = None,
    name_suffix: Annotated[bool, typer.Option("--name-suffix", help="When a live run has the spec's name, name this "
                                              "one NAME-2 (the first NAME-N no run has) instead of refusing it: a "
                                              "name is unique among live runs.")] = False,
    start: Annotated[SubmitStart | None, typer.Option(help="Trainer runs whose output_dir holds another run's "
                                                      "checkpoint (refused without it): resume continues it, fresh "
                                                      "empties the directory first.", case_sensitive=False)] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Then watch it until it ends; the exit code says "
                                        "how it ended.")] = False,
    interval: Interval = 1.0,
    every: Every = 5.0,
    as_json: JsonFlag = False,
) -> int:
    """Submit a run; with --watch, follow it to its end."""
    begin(as_json)
    spec = read_spec(spec_file)
    with connect(ctx) as client:
        for line in resolve_paths(spec, spec_file, lambda host: client.host(host)["workspace"]):
            stderr().print(Text(f"resolved {line}"), soft_wrap=True)
        run = client.submit(spec, idempotency_key=idempotency_key, name_suffix=name_suffix,
                            start=start.value if start else None)
        if as_json:
            print_json(run, lines=watch)
        else:
            stdout().print(Text.assemble("submitted ", (run["id"], "bold"), f" ({run['name']}): ",
                                         run["status"], "" if watch else f"; follow it with `longrun watch {run['id']}`"))
        return follow_run(client, run["id"], interval, every, as_json) if watch else ExitCode.OK


@app.command()
def status(
    ctx: typer.Context,
    run_id: Annotated[str | None, typer.Argument(help="One run in detail; without it, the newest runs.")] = None,
    state: Annotated[str | None, typer.Option(help="Only runs in this state (queued, running, failed, ...).")] = None,
    limit: Annotated[int, typer.Option(help="How many runs to list.", min=1, max=500)] = 20,
    as_json: JsonFlag = False,
) -> int:
    """One run with its attempts, or the newest runs as a table."""
    begin(as_json)
    with connect(ctx) as client:
        if run_id:
            run = client.get(run_id)
            emit(run, as_json, Group(run_panel(run, min(stdout().width, 120)), attempts_table(run)))
        else:
            page = client.list(status=state, limit=limit)
            emit(page, as_json, runs_table(page["items"]) if page["items"] else "no runs")
    return ExitCode.OK


@app.command()
def watch(
    ctx: typer.Context,
    run_id: RunId,
    interval: Interval = 1.0,
    every: Every = 5.0,
    as_json: JsonFlag = False,
) -> int:
    """Live progress until the run ends: state, ETA, loss, accuracy per TTT step, GPUs.

    Exits with the run's outcome: 0 succeeded, 1 failed, 3 cancelled."""
    begin(as_json)
    with connect(ctx) as client:
        return follow_run(client, run_id, interval, every, as_json)


@app.command()
def cancel(
    ctx: typer.Context,
    run_id: RunId,
    wait: Annotated[bool, typer.Option("--wait", help="Return once no process of the run is left (exit 0), "
                                       "or with the run's outcome if it ended otherwise meanwhile.")] = False,
    interval: Interval = 0.5,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before stopping a live attempt (asked on a "
                                      "terminal only).")] = False,
    as_json: JsonFlag = False,
) -> int:
    """Stop a run on every node and verify that no process remains."""
    begin(as_json)
    with connect(ctx) as client:
        run = client.get(run_id)
        if run["status"] in LIVE:
            confirm(f"Cancel {run['name']} [{run['id']}] ({run['status']}, attempt {run['attempt']})?", yes)
        run = client.cancel(run["id"])
        run_id = run["id"]
        if wait:
            *_, run = client.watch(run_id, interval=interval, on_reconnect=_reconnecting)
        emit(run, as_json, Text.assemble(run["id"], ": ", run["status"]))
        if not wait or run["status"] == "cancelled":
            return ExitCode.OK
        return outcome_code(run["status"])


@app.command()
def delete(
    ctx: typer.Context,
    run_id: RunId,
    yes: YesFlag = False,
    as_json: JsonFlag = False,
) -> int:
    """Forget an ended run with its metrics, logs and events (refused while it has not ended: cancel it first);
    the files its attempts left on the host stay."""
    begin(as_json)
    with connect(ctx) as client:
        run = client.get(run_id)
        confirm(f"Delete run {run['name']} [{run['id']}] ({run['status']}) with its metrics and logs?", yes)
        client.delete(run["id"])
    emit({"id": run["id"], "deleted": True}, as_json, Text.assemble("deleted ", (run["id"], "bold"),
                                                                    f" ({run['name']})"))
    return ExitCode.OK


@app.command()
def restart(
    ctx: typer.Context,
    run_id: RunId,
    set_: Annotated[list[str] | None, typer.Option("--set", metavar="KEY=VALUE", help="A changed setting "
                                                   "(repeatable), the value as JSON when it parses: "
                                                   "ttt_steps=5, args='[\"--steps\",\"10\"]'.")] = None,
    ttt_steps: Annotated[int | None, typer.Option(help="Trainer runs: the new TTT depth (as --set ttt_steps=N).",
                                                  min=1)] = None,
    start: Annotated[Start | None, typer.Option(help="Trainer runs: where the new attempt starts. fresh: empty the "
                                                "output directory, train from step 0; resume: continue the newest "
                                                "checkpoint (at the new depth, its remaining steps only); warm: "
                                                "train from step 0 from the last exported draft's weights. Without "
                                                "it the newest checkpoint is resumed, and a depth change over one "
                                                "is refused.", case_sensitive=False)] = None,
    # the earlier spellings, kept working and documented once (README, "Restarting deeper"): --fresh and --clean
    # are --start fresh, --resume --start resume, --init-from-last --start warm
    clean: Annotated[bool, typer.Option("--clean", "--fresh", hidden=True, help="--start fresh.")] = False,
    resume: Annotated[bool, typer.Option("--resume", hidden=True, help="--start resume.")] = False,
    init_from_last: Annotated[bool, typer.Option("--init-from-last", hidden=True, help="--start warm.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only show what would change, whether it resumes a "
                                          "checkpoint, and the new attempt's duration; nothing changes.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before stopping a live attempt (asked on a "
                                      "terminal only).")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Then watch the new attempt until the run ends.")] = False,
    interval: Interval = 1.0,
    every: Every = 5.0,
    as_json: JsonFlag = False,
) -> int:
    """Relaunch a run as a new attempt, optionally with changed settings."""
    begin(as_json)
    overrides = parse_assignments(set_ or [])
    if ttt_steps is not None:
        overrides["ttt_steps"] = ttt_steps
    clean, resume, init_from_last = start_flags(start, clean, resume, init_from_last)
    with connect(ctx) as client:
        run = client.get(run_id)

        def ask_server(dry: bool) -> dict[str, Any]:
            return client.restart(run["id"], overrides, clean=clean, init_from_last=init_from_last, dry_run=dry,
                                  resume=resume)

        if not dry_run and run["status"] in LIVE:
            # its dry run first: a restart the server refuses is refused before anyone is asked to stop an attempt
            plan = ask_server(True)
            if run["status"] == "running" and (run.get("progress") or 0) >= 1:
                run = _after_final_evaluation(client, run, yes, interval)
            else:
                confirm(f"Stop attempt {run['attempt']} of {run['name']} ({run['status']}) and relaunch it "
                        f"({plan.get('start', 'unknown')}: {plan.get('start_reason', '')})?", yes)
        answer = ask_server(dry_run)
        if as_json:
            print_json(answer, lines=watch and not dry_run)
        elif dry_run:
            current = next(a for a in run["attempts"] if a["number"] == run["attempt"])["spec"]
            for line in spec_diff(current, answer["new_spec"]) or ["the spec is unchanged"]:
                stdout().print(Text(line))
            stdout().print(Text(f"start: {answer.get('start', 'unknown')}: {answer.get('start_reason', '')}"))
            predicted = answer.get("predicted_duration_seconds")
            stdout().print(Text(f"the new attempt would take {duration(predicted) if predicted else 'an unknown time'}"
                                f" ({answer['basis']})"))
        else:
            stdout().print(Text.assemble(answer["id"], f": attempt {answer['attempt']}, ", answer["status"]))
        if watch and not dry_run:
            return follow_run(client, run_id, interval, every, as_json)
    return ExitCode.OK


def _after_final_evaluation(client: Client, run: dict[str, Any], yes: bool, interval: float) -> dict[str, Any]:
    """An attempt that has trained its last step is in its final validation, evaluation and export: a restart waits
    for them to end (asked on a terminal whether to stop them instead), so that what they measure is kept."""
    wait = asked(f"Attempt {run['attempt']} of {run['name']} has trained all its steps and is in its final "
                 "evaluation. Wait for it to end before restarting? (no: stop it now)", yes)
    if wait is False:
        return run
    stderr().print(Text(f"waiting for attempt {run['attempt']} of {run['name']} to end its final evaluation "
                        "(Ctrl-C stops waiting; the run goes on)"), soft_wrap=True)
    while run["status"] in LIVE:
        time.sleep(interval)
        run = client.get(run["id"])
    return run


@app.command()
def logs(
    ctx: typer.Context,
    run_id: RunId,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing lines as they come, into the next "
                                         "attempt after a restart, until the run ends; exits with its outcome.")] = False,
    tail: Annotated[int, typer.Option(help="Lines from the end to start with.", min=0)] = 50,
    attempt: Annotated[int | None, typer.Option(help="This attempt's log (default: the current one); -f then "
                                                "follows this attempt only.", min=1)] = None,
    node: Annotated[int, typer.Option(help="Which node's log in a multi-host run (0 is the first host).",
                                      min=0)] = 0,
    rank: Annotated[int | None, typer.Option(help="Instead of the log: this failed rank's traceback (what it "
                                             "recorded with torch elastic's @record), from the attempt's failure "
                                             "summary.", min=0)] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Print the log's lines as the job wrote them, terminal "
                                      "control sequences and all (by default they are removed: a job's log could "
                                      "otherwise clear your screen or write your clipboard).")] = False,
    interval: Interval = 1.0,
    as_json: JsonFlag = False,
) -> int:
    """An attempt's log, or with --rank a failed rank's traceback."""
    begin(as_json)
    if rank is not None:
        if follow:
            raise typer.BadParameter("--rank shows a traceback once the rank has failed: leave out --follow")
        with connect(ctx) as client:
            failed = client.traceback(run_id, rank, attempt)
        cause = " (the first to fail)" if failed["root_cause"] else ""
        emit(failed, as_json, safe(f"attempt {failed['attempt']}, rank {failed['rank']} on node {failed['node']}"
                                   f"{cause}:\n{failed['traceback']}", multiline=True))
        return ExitCode.OK

    def show(number: int, lines: list[str]) -> None:
        for line in lines:
            if as_json:
                print_json({"attempt": number, "node": node, "line": line}, lines=True)
            else:
                sys.stdout.write((line if raw else clean(line)) + "\n")
        sys.stdout.flush()

    with connect(ctx) as client:
        if follow:
            run_id = client.get(run_id)["id"]  # resolved once, as watch does
        page = client.logs(run_id, tail=tail, attempt=attempt, node=node)
        current, offset = page["attempt"], page["next_offset"]
        show(current, page["lines"])

        def read_more() -> bool:
            """Show what the current attempt wrote since `offset`; whether it wrote anything."""
            nonlocal offset
            page = client.through_restarts(lambda at=offset, number=current: client.logs(
                run_id, since_offset=at, attempt=number, node=node), on_reconnect=_reconnecting)
            show(current, page["lines"])
            offset = page["next_offset"]
            return bool(page["lines"])

        while follow:
            time.sleep(interval)
            if read_more():
                continue
            run = client.through_restarts(lambda: client.get(run_id), on_reconnect=_reconnecting)
            attempt_over = run["status"] in TERMINAL or run["attempt"] > current
            # lines written between that read and this answer are read before leaving the attempt
            if attempt_over and read_more():
                continue
            if attempt is None and run["attempt"] > current:
                current, offset = current + 1, 0
                if not as_json:
                    stderr().rule(f"attempt {current}")
                continue
            if attempt_over:
                ended = next(a for a in run["attempts"] if a["number"] == current)
                return outcome_code(run["status"] if run["attempt"] == current else ended["status"])
    return ExitCode.OK
