"""How runs and hosts look on a terminal: rich renderables for people, one plain line for logs and pipes.

The watch panel fits the width it is given at any TTT depth and GPU count: the accuracies per TTT step and
the GPUs wrap into rows, and the first line (state, attempt, ETA, step rate) never wraps away. Every string the
server holds (names, ids, hosts, workspaces, messages, paths) goes in as `Text` (longrun/safe_text.py `safe`: its
terminal controls removed), never as rich markup: a run named `[/]` is shown as it is named."""

import re
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from longrun.safe_text import safe
from trainer import series

# the GPU series of server/series.py (tests/test_shared_names.py pins this copy)
GPU_KEY = re.compile(r"^(?:node(?P<node>\d+)_)?gpu_(?P<kind>util|mem)_(?P<gpu>\d+)$")
# one style per status of longrun.client.RUN_STATUSES and ATTEMPT_STATUSES
STATE_STYLES = {"queued": "cyan", "launching": "cyan", "running": "green", "restarting": "yellow", "pending": "cyan",
                "cancelling": "yellow", "succeeded": "bold green", "failed": "bold red", "cancelled": "magenta"}
# the server's markers of a non-finite value in a run's latest (worker/metric_values.py), and as a line shows them
NOT_FINITE = frozenset({"NaN", "Infinity", "-Infinity"})
NOT_FINITE_SHOWN = frozenset(m.upper() for m in NOT_FINITE)
ACC_CELL = 8  # "15 0.57" and a space
GPU_CELL = 17  # "n1:7 100% 140.4G" and a space


def duration(seconds: float | None) -> str:
    """`45s`, `4m 12s`, `1h 23m`, `2d 3h`: the page's format (server/web/dom.js), so both say the same."""
    if seconds is None:
        return "—"
    s = max(0, round(seconds))
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s % 60:02d}s"
    return f"{s}s"


def step_series(latest: dict[str, Any], prefix: str) -> list[tuple[int, float]]:
    """(k, value) of `<prefix>_<k>` metrics, by k: the per-TTT-step figures."""
    pattern = series.indexed_pattern(prefix)
    found = [(int(m.group(1)), v) for k, v in latest.items() if (m := pattern.match(k)) and isinstance(v, int | float)]
    return sorted(found)


def gpu_readings(latest: dict[str, Any]) -> list[tuple[str, float | None, float | None]]:
    """(label, utilisation %, memory MiB) per GPU the run uses; labels name the node past the first."""
    gpus: dict[tuple[int, int], dict[str, float]] = {}
    for key, value in latest.items():
        if (m := GPU_KEY.match(key)) and isinstance(value, int | float):
            gpus.setdefault((int(m["node"] or 0), int(m["gpu"])), {})[m["kind"]] = value
    return [(f"n{node}:{gpu}" if node else str(gpu), v.get("util"), v.get("mem"))
            for (node, gpu), v in sorted(gpus.items())]


def current_attempt(run: dict[str, Any]) -> dict[str, Any] | None:
    return next((a for a in run.get("attempts", []) if a["number"] == run["attempt"]), None)


def step_rate(run: dict[str, Any]) -> float | None:
    current = current_attempt(run)
    seconds = current.get("seconds_per_step") if current else None
    return 1 / seconds if seconds else None


def ttt_depth(run: dict[str, Any]) -> int | None:
    trainer = (run.get("spec") or {}).get("trainer") or {}
    return trainer.get("ttt_steps") or (run.get("latest") or {}).get(series.TTT_STEPS)


def comparable_loss(latest: dict[str, Any], key: str = series.LOSS) -> tuple[str, float | str] | None:
    """(name, value) of the loss that compares across TTT depths: `loss_0` (TTT step 0's, what the page charts), not
    `loss`, which sums w^k * loss_k over the steps and so grows with the depth (14.78 at TTT=5 against 10.73 at
    TTT=3 for the same draft); `loss` itself for a trainer that logs no per-step losses. `key` val_loss for the
    validation's. The value may be a marker of a non-finite loss ("NaN", "Infinity", "-Infinity")."""
    for name in (series.indexed(key, 0), key):
        value = latest.get(name)
        if isinstance(value, int | float) or value in NOT_FINITE:
            return name, value
    return None


def figure(value: float | str, digits: int = 4) -> str:
    """A metric's value: the number, or the server's marker of a non-finite one (JSON has no NaN) as it is."""
    return value if isinstance(value, str) else f"{value:.{digits}f}"


def loss_figures(latest: dict[str, Any]) -> list[str]:
    """The training and validation losses a line shows, each the comparable one; a non-finite one in capitals."""
    found = [comparable_loss(latest, key) for key in (series.LOSS, series.VAL_LOSS)]
    return [f"{name} {figure(value).upper()}" if isinstance(value, str) else f"{name} {figure(value)}"
            for name, value in filter(None, found)]


def progress_line(run: dict[str, Any]) -> str:
    """One line for logs and pipes, state and ETA first: progress, step, loss, accuracy by TTT step (the first
    four and the last when deeper), step rate, mean GPU use."""
    latest = run.get("latest") or {}
    p = run.get("progress")
    parts = [f"{run['status']} (attempt {run['attempt']})", f"ETA {duration(run.get('eta_seconds'))}",
             f"{p * 100:.1f}%" if p is not None else "?%"]
    if series.STEP in latest:
        parts.append(f"step {int(latest[series.STEP])}/{int(latest.get(series.TOTAL_STEPS, 0)) or '?'}")
    parts += loss_figures(latest)
    accs = [f"{v:.2f}" for _, v in step_series(latest, series.ACC)]
    if accs:
        parts.append("acc " + "/".join(accs if len(accs) <= 6 else [*accs[:4], "..", accs[-1]])
                     + (f" ({len(accs)} steps)" if len(accs) > 6 else ""))
    rate = step_rate(run)
    if rate:
        parts.append(f"{rate:.2f} step/s")
    utils = [u for _, u, _ in gpu_readings(latest) if u is not None]
    if utils:
        parts.append(f"gpu {sum(utils) / len(utils):.0f}% x{len(utils)}")
    if run.get("input_bound"):
        parts.append(f"input-bound {run['input_bound']['share']:.0%}")
    return " | ".join(parts)


def state_text(status: str) -> Text:
    return safe(status, style=STATE_STYLES.get(status, ""))


LABEL_WIDTH = 8  # "val_acc" and a space


def _wrapped_grid(cells: list[Text], cell_width: int, width: int, label: str) -> Table:
    """`cells` in as many columns as fit in `width` after the label column, row after row."""
    label_width = LABEL_WIDTH
    per_row = max(1, (width - label_width) // cell_width)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=label_width - 1, style="dim")
    for _ in range(min(per_row, len(cells))):
        grid.add_column(width=cell_width - 1, no_wrap=True)
    for start in range(0, len(cells), per_row):
        grid.add_row(label if start == 0 else "", *cells[start:start + per_row])
    return grid


def run_panel(run: dict[str, Any], width: int = 80) -> Panel:
    """The watch view: a panel `width` columns wide, whatever the TTT depth and GPU count."""
    inner = max(width - 4, 20)  # borders and padding
    latest = run.get("latest") or {}
    head = Text.assemble(state_text(run["status"]), f"  attempt {run['attempt']}",
                         f"  ETA {duration(run.get('eta_seconds'))}")
    rate = step_rate(run)
    if rate:
        head.append(f"  {rate:.2f} step/s")
    depth = ttt_depth(run)
    if depth:
        head.append(f"  TTT {depth}")
    head.no_wrap, head.overflow = True, "ellipsis"
    rows: list[RenderableType] = [head]

    p = run.get("progress")
    step = (f"step {int(latest[series.STEP])}/{int(latest.get(series.TOTAL_STEPS, 0)) or '?'}"
            if series.STEP in latest else "")
    label = f"{p * 100:5.1f}%  {step}" if p is not None else step
    bar = Table.grid(padding=(0, 1))
    bar.add_column(width=max(inner - 26, 10))
    bar.add_column(no_wrap=True)
    bar.add_row(ProgressBar(total=1.0, completed=p or 0.0), label)
    rows.append(bar)

    losses = loss_figures(latest)
    figures = losses + ([f"epoch {figure(latest[series.EPOCH], 2)}"] if series.EPOCH in latest else [])
    figures += [f"{figure(latest[series.TOKENS_PER_S], 0)} tok/s"] if series.TOKENS_PER_S in latest else []
    if figures:
        diverged = any(f.rpartition(" ")[2] in NOT_FINITE_SHOWN for f in losses)
        rows.append(Text("  ".join(figures), style="bold red" if diverged else "", no_wrap=True, overflow="ellipsis"))
    for prefix, label_text in ((series.ACC, f"{series.ACC}_k"), (series.VAL_ACC, series.VAL_ACC)):
        by_step = step_series(latest, prefix)
        if by_step:
            cells = [Text.assemble((f"{k:>2} ", "dim"), f"{v:.2f}") for k, v in by_step]
            rows.append(_wrapped_grid(cells, ACC_CELL, inner, label_text))
    gpus = gpu_readings(latest)
    if gpus:
        cells = [Text.assemble((f"{name:>4} ", "dim"), "   -" if util is None else f"{util:3.0f}%",
                               "" if mem is None else f" {mem / 1024:5.1f}G") for name, util, mem in gpus]
        rows.append(_wrapped_grid(cells, GPU_CELL, inner, "gpu"))
    if run.get("input_bound"):  # the server's words: the disk, not the GPU, sets the pace, and what to do
        rows.append(safe(run["input_bound"]["note"], style="yellow"))
    if run.get("message"):
        rows.append(safe(run["message"], style="dim", no_wrap=True, overflow="ellipsis"))
    title = safe(f"{run['name']} [{run['id']}]", no_wrap=True)
    if len(title) > inner - 2:
        title = title[: inner - 3] + "…"
    return Panel(Group(*rows), title=title, title_align="left", width=width, padding=(0, 1))


def runs_table(runs: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, options in (("ID", {"no_wrap": True}), ("NAME", {"overflow": "ellipsis", "max_width": 24}),
                          ("STATE", {}), ("HOST", {"overflow": "ellipsis", "max_width": 16}),
                          ("ATT", {"justify": "right"}), ("PROGRESS", {"justify": "right"}), ("ETA", {}),
                          ("TTT", {"justify": "right"}), ("LOSS (TTT 0)", {"justify": "right"})):
        table.add_column(name, **options)
    for run in runs:
        p, loss = run.get("progress"), comparable_loss(run.get("latest") or {})
        table.add_row(safe(run["id"]), safe(run["name"]), state_text(run["status"]),
                      safe(",".join(run.get("hosts") or [])),
                      str(run["attempt"]), "" if p is None else f"{p * 100:.0f}%", duration(run.get("eta_seconds")),
                      str(ttt_depth(run) or ""), "" if loss is None else figure(loss[1]))
    return table


def attempts_table(run: dict[str, Any]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("ATTEMPT", "STATE", "EXIT", "STEPS", "TOOK", "LOG", "MESSAGE"):
        table.add_column(name, overflow="fold" if name in ("LOG", "MESSAGE") else "ellipsis")
    for a in run["attempts"]:
        steps = f"{a.get('last_step') or 0}/{a.get('total_steps') or '?'}"
        table.add_row(str(a["number"]), state_text(a["status"]), "" if a["exit_code"] is None else str(a["exit_code"]),
                      steps, duration(a.get("actual_duration_seconds")), safe(a.get("log_path")),
                      safe(a.get("message")))
    return table


def host_address(host: dict[str, Any]) -> str:
    """Where the host is reached: once the worker has reached it, where it connected, its ~/.ssh/config applied
    (`gpu-box -> ml@10.1.2.3:2222`); before that `address:port`, or the address alone for port 22, the registration's
    default, which yields to the `Port` of an alias in the worker's ~/.ssh/config (worker/ssh_reach.py)."""
    port = host.get("port")
    given = host["address"] if not port or port == 22 else f"{host['address']}:{port}"  # local: no port
    reached = host.get("reached")
    return given if not reached else f"{given} -> {reached}"


def hosts_table(hosts: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("NAME", "ADDRESS", "WORKSPACE", "STATE"):
        table.add_column(name, overflow="fold")
    for h in hosts:
        state = {True: Text("reachable", style="green"), False: Text("UNREACHABLE", style="bold red"),
                 None: Text("not contacted yet", style="dim")}[h["reachable"]]
        table.add_row(safe(h["name"]), safe(host_address(h)), safe(h["workspace"]), state)
    return table


def host_state(host: dict[str, Any]) -> Text:
    """One host's state in words, and when it is unreachable why and what fixes it: the worker's error says both
    (an unknown host key's names the `hosts update --host-key` line that pins it)."""
    name, reachable, error = host["name"], host.get("reachable"), host.get("last_error")
    if reachable is False:
        return Text.assemble(safe(name), " is ", ("UNREACHABLE", "bold red"), ": ",
                             safe(error or "the worker gave no reason", multiline=True))
    if reachable:
        seen = f" (last answered {host['last_seen_at']})" if host.get("last_seen_at") else ""
        return Text.assemble(safe(name), " is ", ("reachable", "green"), seen)
    return Text.assemble(safe(name), " has ", ("not been contacted yet", "dim"),
                         ": no worker has answered for it (is one running? `longrun serve` starts one)")
