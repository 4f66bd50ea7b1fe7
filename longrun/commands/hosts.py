"""Hosts: `longrun hosts` lists them; `hosts add`, `hosts update`, `hosts remove`, `hosts show`, `hosts gpus`,
`hosts probe-interconnect`, `hosts probe-verifier`."""

import sys
from typing import Annotated

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from longrun.commands.common import JsonFlag, YesFlag, begin, confirm, connect, emit
from longrun.exit_codes import ExitCode
from longrun.safe_text import clean
from longrun.views import host_address, host_state, hosts_table

app = typer.Typer(help="The machines runs go to: list (the default), add, update, remove, show, gpus, "
                  "probe-interconnect, probe-verifier.")

HostName = Annotated[str, typer.Argument(help="The host's name, as runs name it.")]


@app.callback(invoke_without_command=True)
def hosts(ctx: typer.Context, as_json: JsonFlag = False) -> int | None:
    """The hosts, whether the worker reaches them (also `hosts list`)."""
    if ctx.invoked_subcommand is None:
        return list_hosts(ctx, as_json)
    return None


@app.command("list")
def list_hosts(ctx: typer.Context, as_json: JsonFlag = False) -> int:
    """The hosts, whether the worker reaches them."""
    begin(as_json)
    with connect(ctx) as client:
        found = client.hosts()
    emit(found, as_json, hosts_table(found))
    return ExitCode.OK


@app.command()
def add(
    ctx: typer.Context,
    name: HostName,
    address: Annotated[str, typer.Option(help="Where SSH reaches it: a name or an IP address.")],
    workspace: Annotated[str, typer.Option(help="An absolute directory on the host for longrun's files.")],
    port: Annotated[int, typer.Option(help="SSH port.", min=1, max=65535)] = 22,
    username: Annotated[str | None, typer.Option(help="SSH user (default: the server's user).")] = None,
    key_path: Annotated[str | None, typer.Option(help="Private key on the server's machine.")] = None,
    host_key: Annotated[str | None, typer.Option(help="The host's public key line (`ssh-keyscan HOST`, checked "
                                                 "against the host's fingerprint), pinned. Without it the key must be "
                                                 "in the server's ~/.ssh/known_hosts: an unknown key is refused, "
                                                 "never trusted on first use.")] = None,
    python: Annotated[str | None, typer.Option(help="The Python on the host that has torch (default python3).")] = None,
    kind: Annotated[str | None, typer.Option(help="direct (runs start on the host; the default) or slurm (the "
                                             "host is a login node; runs are batch jobs).")] = None,
    as_json: JsonFlag = False,
) -> int:
    """Register a host."""
    begin(as_json)
    with connect(ctx) as client:
        host = client.add_host(name, address, workspace, port=port, username=username, key_path=key_path,
                               host_key=host_key, python=python, kind=kind)
    emit(host, as_json, Group(f"added {host['name']} ({host_address(host)}, workspace {host['workspace']})",
                              host_state(host)))
    return ExitCode.OK


@app.command()
def update(
    ctx: typer.Context,
    name: HostName,
    address: Annotated[str | None, typer.Option(help="Where SSH reaches it: a name or an IP address.")] = None,
    port: Annotated[int | None, typer.Option(help="SSH port.", min=1, max=65535)] = None,
    username: Annotated[str | None, typer.Option(help="SSH user; '' for the server's user.")] = None,
    key_path: Annotated[str | None, typer.Option(help="Private key on the server's machine; '' for the "
                                                 "default keys.")] = None,
    host_key: Annotated[str | None, typer.Option(help="The host's public key line, pinned; '' to use the "
                                                 "server's known_hosts instead.")] = None,
    workspace: Annotated[str | None, typer.Option(help="An absolute directory on the host for longrun's files "
                                                  "(only while no run uses the host).")] = None,
    python: Annotated[str | None, typer.Option(help="The Python on the host that has torch.")] = None,
    as_json: JsonFlag = False,
) -> int:
    """Change a host's settings; the next connection uses them (a run refused by the old key is retried on a
    restart: `longrun restart RUN`)."""
    begin(as_json)
    given = {"address": address, "port": port, "username": username, "key_path": key_path, "host_key": host_key,
             "workspace": workspace, "python": python}
    clearable = {"username", "key_path", "host_key"}
    fields = {k: (None if v == "" and k in clearable else v) for k, v in given.items() if v is not None}
    if not fields:
        raise typer.BadParameter("give at least one setting to change (see --help)")
    with connect(ctx) as client:
        host = client.update_host(name, **fields)
    emit(host, as_json, Group(f"updated {host['name']}: {', '.join(sorted(fields))}", host_state(host)))
    return ExitCode.OK


@app.command()
def remove(
    ctx: typer.Context,
    name: HostName,
    yes: YesFlag = False,
    as_json: JsonFlag = False,
) -> int:
    """Forget a host (refused while a run that has not ended uses it); nothing on the host is touched."""
    begin(as_json)
    confirm(f"Remove host {name}?", yes)
    with connect(ctx) as client:
        client.delete_host(name)
    emit({"name": name, "removed": True}, as_json, f"removed {name}")
    return ExitCode.OK


@app.command()
def show(ctx: typer.Context, name: HostName, as_json: JsonFlag = False) -> int:
    """One host's settings and reachability, and when it is unreachable why and what fixes it."""
    begin(as_json)
    with connect(ctx) as client:
        host = client.host(name)
    emit(host, as_json, Group(hosts_table([host]), host_state(host)))
    return ExitCode.OK


@app.command()
def gpus(
    ctx: typer.Context,
    name: HostName,
    max_age: Annotated[float | None, typer.Option(help="Ask for a fresh look when the last is older (seconds).",
                                                  min=0)] = None,
    wait: Annotated[float | None, typer.Option(help="Seconds to wait for that look.", min=0)] = None,
    as_json: JsonFlag = False,
) -> int:
    """The host's GPUs and the processes on them."""
    begin(as_json)
    with connect(ctx) as client:
        answer = client.host_gpus(name, max_age=max_age, wait=wait)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("GPU", "NAME", "UTIL", "MEMORY", "PROCESSES"):
        table.add_column(column)
    for g in answer.get("gpus", []):
        table.add_row(str(g.get("index")), g.get("name") or "", f"{g.get('utilization_pct') or 0:.0f}%",
                      f"{(g.get('memory_used_mib') or 0) / 1024:.1f} GiB",
                      " ".join(str(p.get("pid")) for p in g.get("processes", [])))
    emit(answer, as_json, table if answer.get("gpus") else answer.get("message") or "no GPUs")
    return ExitCode.OK


@app.command("probe-interconnect")
def probe_interconnect(
    ctx: typer.Context,
    name: HostName,
    tp: Annotated[int | None, typer.Option(help="GPUs in the all-reduce (default: all of the host's).", min=1)] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the table.", min=0)] = 900.0,
    as_json: JsonFlag = False,
) -> int:
    """Measure NCCL all-reduce times on the host's GPUs over the worker's connection; the table is kept with the
    host and used by `advice?deploy_host=NAME`. Exits 1 when the probe did not measure."""
    begin(as_json)
    with connect(ctx) as client:
        table = client.probe_interconnect(name, tp=tp, timeout=timeout)
    if table["status"] == "pending":
        problem = (f"the probe of {name} has not answered within {timeout:g}s; "
                   f"`longrun hosts probe-interconnect {name}` again shows it once it has")
    elif table["status"] == "failed":
        problem = f"the probe of {name} did not measure: {table['message']}"
    else:
        problem = None
    rows = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("BYTES", "ALL-REDUCE µs"):
        rows.add_column(column, justify="right")
    for point in table.get("allreduce") or []:
        rows.add_row(f"{point['bytes']:,}", f"{point['us']:.1f}")
    summary = f"{name}: tp={table.get('tp')}, {table.get('interconnect') or 'no link between GPUs'}"
    emit(table, as_json, rows if table.get("allreduce") else summary)
    if problem:
        print(f"longrun: {clean(problem)}", file=sys.stderr)  # plain: the host's words are not rich markup
        return ExitCode.FAILED
    return ExitCode.OK


@app.command("probe-verifier")
def probe_verifier(
    ctx: typer.Context,
    name: HostName,
    config: Annotated[str, typer.Option(help="The verifier's config.json, or its model directory, on the host.")],
    tp: Annotated[int, typer.Option(help="The engine's tensor parallelism: one rank's share is timed.", min=1)],
    ep: Annotated[int, typer.Option(help="An MoE verifier's expert parallelism: 1 or the tp.", min=1)] = 1,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the times.", min=0)] = 1200.0,
    as_json: JsonFlag = False,
) -> int:
    """Time one decoder layer of the verifier's shape on the host's GPU (random weights of its dtype, 1..16 query
    tokens, as CUDA graphs) over the worker's connection; kept beside the host's all-reduce table, it prices the
    verifier forward of every proposal for a run deployed there. Exits 1 when the probe did not measure."""
    begin(as_json)
    with connect(ctx) as client:
        probe = client.probe_verifier(name, config, tp, ep, timeout=timeout)
    if probe["status"] == "pending":
        problem = (f"the verifier probe of {name} has not answered within {timeout:g}s; "
                   f"`longrun hosts probe-verifier {name} --config {config} --tp {tp} --ep {ep}` again shows it "
                   "once it has")
    elif probe["status"] == "failed":
        problem = f"the verifier probe of {name} did not measure: {probe['message']}"
    else:
        problem = None
    rows = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("TOKENS", "DENSE LAYER ms", "MOE LAYER ms"):
        rows.add_column(column, justify="right")
    dense, moe = probe.get("dense_ms") or [], probe.get("moe_ms") or []
    for i in range(max(len(dense), len(moe))):
        rows.add_row(str(i + 1), *(f"{times[i]:.3f}" if i < len(times) else "" for times in (dense, moe)))
    summary = (f"{name}: {clean(str(probe.get('path')))} at tp={probe.get('tp')} ep={probe.get('ep')} on "
               f"{clean(str(probe.get('gpu')))} ({clean(str(probe.get('dtype')))})")
    emit(probe, as_json, Group(Text(summary), rows) if dense or moe else "no layer times measured")
    if problem:
        print(f"longrun: {clean(problem)}", file=sys.stderr)  # plain: the host's words are not rich markup
        return ExitCode.FAILED
    return ExitCode.OK
