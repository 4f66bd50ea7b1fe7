"""The `longrun` command: the server and worker processes, a client of the REST API, and the depth advisor."""

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from longrun.client import TERMINAL, Client, LongrunError


def _print(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def progress_line(run: dict[str, Any], width: int = 24) -> str:
    """One line: bar, step, loss and accuracies, step rate, GPU use, ETA, state."""
    latest = run.get("latest") or {}
    p = run.get("progress")
    filled = int(round((p or 0) * width))
    bar = "#" * filled + "-" * (width - filled)
    parts = [f"[{bar}] {p * 100:5.1f}%" if p is not None else f"[{bar}]   ?  "]
    if "step" in latest:
        parts.append(f"step {int(latest['step'])}/{int(latest.get('total_steps', 0)) or '?'}")
    for key in ("loss", "val_loss"):
        if key in latest:
            parts.append(f"{key} {latest[key]:.4f}")
    accs = sorted((k for k in latest if k.startswith("acc_")), key=lambda k: int(k.split("_")[1]))
    if accs:
        parts.append("acc " + "/".join(f"{latest[k]:.2f}" for k in accs))
    current = next((a for a in run.get("attempts", []) if a["number"] == run["attempt"]), None)
    if current and current.get("seconds_per_step"):
        parts.append(f"{1 / current['seconds_per_step']:.2f} step/s")
    gpus = sorted((k for k in latest if k.startswith("gpu_util_")), key=lambda k: int(k.rsplit("_", 1)[1]))
    if gpus:
        parts.append("gpu " + " ".join(f"{latest[k]:.0f}%" for k in gpus))
    parts.append(f"ETA {_duration(run.get('eta_seconds'))}")
    parts.append(f"{run['status']} (attempt {run['attempt']})")
    return " | ".join(parts)


def cmd_watch(client: Client, args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    last_status, last_print = None, 0.0
    for run in client.watch(args.id, interval=args.interval):
        key = (run["status"], run["attempt"])
        if key != last_status:
            if tty and last_status is not None:
                print()
            print(f"{run['name']} [{run['id']}]: {run['status']} (attempt {run['attempt']})"
                  + (f" - {run['message']}" if run.get("message") else ""))
            last_status = key
        line = progress_line(run)
        if tty:
            print("\r" + line[: os.get_terminal_size().columns - 1].ljust(80), end="", flush=True)
        elif time.time() - last_print >= args.every:
            print(line, flush=True)
            last_print = time.time()
    if tty:
        print()
    print(progress_line(run))
    return 0 if run["status"] == "succeeded" else 1


def _parse_set(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            sys.exit(f"longrun: --set takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    _print(client.submit(args.file.read_bytes(), idempotency_key=args.idempotency_key))
    return 0


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    _print(client.cancel(args.id))
    return 0


def cmd_restart(client: Client, args: argparse.Namespace) -> int:
    _print(client.restart(args.id, _parse_set(args.set), clean=args.clean, init_from_last=args.init_from_last,
                          dry_run=args.dry_run))
    return 0


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    if args.id:
        run = client.get(args.id)
        if args.json:
            _print(run)
        else:
            print(f"{run['name']} [{run['id']}] {run['status']} (attempt {run['attempt']})"
                  + (f": {run['message']}" if run.get("message") else ""))
            print(progress_line(run))
            for a in run["attempts"]:
                print(f"  attempt {a['number']}: {a['status']} exit={a['exit_code']} log={a['log_path']}"
                      + (f" - {a['message']}" if a.get("message") else ""))
        return 0
    page = client.list(limit=args.limit)
    if args.json:
        _print(page)
        return 0
    for run in page["items"]:
        p = run.get("progress")
        print(f"{run['id']}  {run['status']:<10} {run['name']:<30} attempt {run['attempt']}  "
              f"{'' if p is None else f'{p * 100:.0f}%'}  ETA {_duration(run.get('eta_seconds'))}")
    return 0


def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    page = client.logs(args.id, tail=args.tail, attempt=args.attempt)
    for line in page["lines"]:
        print(line)
    while args.follow:
        time.sleep(1)
        page = client.logs(args.id, since_offset=page["next_offset"], attempt=page["attempt"])
        for line in page["lines"]:
            print(line, flush=True)
        if not page["lines"] and client.get(args.id)["status"] in TERMINAL:
            return 0
    return 0


def cmd_hosts(client: Client, args: argparse.Namespace) -> int:
    if args.action == "add":
        _print(client.add_host(args.name, args.address, args.workspace, port=args.port, username=args.username,
                               key_path=args.key_path, host_key=args.host_key or None, python=args.python))
    elif args.action == "gpus":
        _print(client.host_gpus(args.name))
    elif args.action == "probe-interconnect":
        return cmd_probe_interconnect(client, args)
    else:
        for h in client.hosts():
            state = {True: "reachable", False: "UNREACHABLE", None: "not contacted yet"}[h["reachable"]]
            print(f"{h['name']:<16} {h['address']}:{h['port']:<6} {h['workspace']}  {state}")
    return 0


def cmd_probe_interconnect(client: Client, args: argparse.Namespace) -> int:
    """Measure the host's all-reduce times over the worker's connection; the table as JSON, exit 1 if none."""
    if not args.name:
        sys.exit("longrun: hosts probe-interconnect needs the host's name")
    table = client.probe_interconnect(args.name, tp=args.tp, timeout=args.timeout)
    _print(table)
    if table["status"] == "pending":
        sys.exit(f"longrun: the probe of {args.name} has not answered within {args.timeout:g}s; "
                 f"`longrun hosts probe-interconnect {args.name}` again shows it once it has")
    if table["status"] == "failed":
        sys.exit(f"longrun: the probe of {args.name} did not measure: {table['message']}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from longrun.processes import serve

    serve(args.host, args.port, with_worker=not args.no_worker)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from longrun.processes import work

    work()
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from sqlalchemy.engine import make_url

    from longrun.processes import open_database

    settings, _ = open_database()
    # the URL may hold the database's password: logs (the compose migration job's) must not
    print(f"database at {make_url(settings.resolved_database_url).render_as_string(hide_password=True)} is up to date")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    """Depth advice for an evaluation file, as JSON; bad input exits 2 with the reason."""
    from server.advisor import CostModel, advise, compare_interconnects, load_allreduce_table

    overrides: dict[str, object] = {
        field: value
        for field, value in (
            ("draft_step_ms", args.draft_ms),
            ("verifier_base_ms", args.verifier_ms),
            ("verifier_per_token_ms", args.verifier_per_token_ms),
            ("layers", args.layers),
            ("hidden", args.hidden),
        )
        if value is not None
    }
    try:
        with open(args.evaluation) as f:
            try:
                evaluation = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.evaluation} is not JSON: {exc}") from None
        if args.allreduce_table:
            if args.interconnect == "both":
                args.parser.error("--allreduce-table is one interconnect's table: pick --interconnect pcie or nvlink")
            overrides["allreduce_us"] = load_allreduce_table(args.allreduce_table)
        seconds = {}
        for item in args.retrain_seconds:
            ttt, _, value = item.partition("=")
            try:
                seconds[int(ttt)] = float(value)
            except ValueError:
                raise ValueError(f"--retrain-seconds wants TTT=SECONDS, e.g. 5=5400; got {item!r}") from None
        if args.interconnect == "both":
            result = compare_interconnects(evaluation, args.tp, args.trained_ttt, seconds or None, args.min_gain,
                                           **overrides)
        else:
            cost = CostModel.for_interconnect(args.interconnect, args.tp, **overrides)
            result = advise(evaluation, args.interconnect, args.tp, cost, args.trained_ttt, seconds or None,
                            args.min_gain)
    except (OSError, ValueError) as exc:
        args.parser.error(str(exc))
    json.dump(result.model_dump(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _add_advise(sub: Any) -> None:
    from server.advisor import INTERCONNECTS, NAMED_ALLREDUCE_TABLES

    s = sub.add_parser(
        "advise", help="depth advice from an evaluation file",
        description="Expected tokens/s per speculation depth, the depth to serve, and whether a deeper TTT "
        "retrain pays off. Defaults: a 70B-class verifier (80 layers, hidden 8192) on H200s; "
        "PCIe is the NVLink all-reduce table plus 3 µs per ring step per call (2*(tp-1) steps).",
    )
    s.add_argument("--evaluation", required=True, help="JSON from `python -m trainer.evaluate`")
    s.add_argument("--interconnect", choices=[*INTERCONNECTS, "both"], default="both")
    s.add_argument("--tp", type=int, default=8, help="tensor-parallel degree of the verifier (default 8)")
    s.add_argument("--draft-ms", type=float, help="draft time per proposed token, ms")
    s.add_argument("--verifier-ms", type=float, help="verifier forward per round without communication, ms")
    s.add_argument("--verifier-per-token-ms", type=float, help="extra verifier time per verified token, ms")
    s.add_argument("--layers", type=int, help="verifier layers")
    s.add_argument("--hidden", type=int, help="verifier hidden size")
    s.add_argument(
        "--allreduce-table", metavar="FILE|NAME",
        help="all-reduce times, JSON like tests/fixtures/h200x2/allreduce-*.json, or a named table: "
        + ", ".join(NAMED_ALLREDUCE_TABLES),
    )
    s.add_argument("--trained-ttt", type=int, help="TTT steps the draft was trained with")
    s.add_argument(
        "--retrain-seconds", action="append", default=[], metavar="TTT=SECONDS",
        help="predicted training time for a TTT depth (repeatable), e.g. 5=5400",
    )
    s.add_argument("--min-gain", type=float, default=0.02, help="least speed-up worth a retrain (default 0.02)")
    s.set_defaults(func=cmd_advise, parser=s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="longrun", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="API server with the embedded worker")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--no-worker", action="store_true", help="API only; run `longrun worker` separately")
    s.set_defaults(func=cmd_serve)
    sub.add_parser("worker", help="the worker loop alone").set_defaults(func=cmd_worker)
    sub.add_parser("migrate", help="create or upgrade the database schema").set_defaults(func=cmd_migrate)

    s = sub.add_parser("submit", help="submit a run from a JSON spec file")
    s.add_argument("file", type=Path)
    s.add_argument("--idempotency-key")
    s.set_defaults(api=cmd_submit)

    s = sub.add_parser("status", help="one run, or the newest runs")
    s.add_argument("id", nargs="?")
    s.add_argument("--json", action="store_true")
    s.add_argument("--limit", type=int, default=20)
    s.set_defaults(api=cmd_status)

    s = sub.add_parser("watch", help="live progress until the run ends")
    s.add_argument("id")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--every", type=float, default=5.0, help="seconds between lines when not on a terminal")
    s.set_defaults(api=cmd_watch)

    s = sub.add_parser("cancel", help="stop a run and verify no process remains")
    s.add_argument("id")
    s.set_defaults(api=cmd_cancel)

    s = sub.add_parser("restart", help="relaunch as a new attempt, optionally with changed settings")
    s.add_argument("id")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. ttt_steps=5")
    s.add_argument("--clean", action="store_true", help="empty the output directory first")
    s.add_argument("--init-from-last", action="store_true", help="trainer runs: warm start from the last draft")
    s.add_argument("--dry-run", action="store_true", help="only predict the new attempt's duration")
    s.set_defaults(api=cmd_restart)

    s = sub.add_parser("logs", help="an attempt's log")
    s.add_argument("id")
    s.add_argument("-f", "--follow", action="store_true")
    s.add_argument("--tail", type=int, default=50)
    s.add_argument("--attempt", type=int)
    s.set_defaults(api=cmd_logs)

    s = sub.add_parser("hosts", help="list, add, show the GPUs of hosts, or measure their all-reduce times")
    s.add_argument("action", nargs="?", choices=["list", "add", "gpus", "probe-interconnect"], default="list")
    s.add_argument("name", nargs="?")
    s.add_argument("--address")
    s.add_argument("--port", type=int, default=22)
    s.add_argument("--username")
    s.add_argument("--key-path")
    s.add_argument("--workspace")
    s.add_argument("--host-key")
    s.add_argument("--python")
    s.add_argument("--tp", type=int, help="probe-interconnect: GPUs in the all-reduce (default: all of the host's)")
    s.add_argument("--timeout", type=float, default=900.0, help="probe-interconnect: seconds to wait for the table")
    s.set_defaults(api=cmd_hosts)

    _add_advise(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    daemon = bool(argv) and argv[0] in ("serve", "worker", "migrate")
    logging.basicConfig(level=os.environ.get("LONGRUN_LOG_LEVEL", "INFO" if daemon else "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if not hasattr(args, "api"):
        return args.func(args)
    try:
        with Client() as client:
            return args.api(client, args)
    except LongrunError as exc:
        sys.exit(f"longrun: {exc}")


if __name__ == "__main__":
    sys.exit(main())
