"""The `longrun` command: the server and worker processes, and a client of the REST API."""

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from server.config import Settings

TERMINAL = {"succeeded", "failed", "cancelled"}


def _client() -> httpx.Client:
    url = os.environ.get("LONGRUN_URL", "http://127.0.0.1:8080")
    token = os.environ.get("LONGRUN_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30)


def _call(method: str, path: str, **kwargs: Any) -> Any:
    with _client() as c:
        try:
            r = c.request(method, path, **kwargs)
        except httpx.ConnectError:
            sys.exit(f"longrun: cannot reach the server at {c.base_url} (start it with `longrun serve`, "
                     "or set LONGRUN_URL)")
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail")
        except ValueError:
            detail = r.text
        if isinstance(detail, list):
            detail = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in detail)
        sys.exit(f"longrun: {r.status_code} {detail}")
    return r.json()


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


def cmd_watch(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty()
    last_status, last_print = None, 0.0
    while True:
        run = _call("GET", f"/v1/runs/{args.id}")
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
        if run["status"] in TERMINAL:
            if tty:
                print()
            print(progress_line(run))
            return 0 if run["status"] == "succeeded" else 1
        time.sleep(args.interval)


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


def cmd_restart(args: argparse.Namespace) -> int:
    body = {"overrides": _parse_set(args.set), "clean": args.clean, "init_from_last": args.init_from_last}
    _print(_call("POST", f"/v1/runs/{args.id}/restart", params={"dry_run": str(args.dry_run).lower()}, json=body))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if args.id:
        run = _call("GET", f"/v1/runs/{args.id}")
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
    page = _call("GET", "/v1/runs", params={"limit": args.limit})
    if args.json:
        _print(page)
        return 0
    for run in page["items"]:
        p = run.get("progress")
        print(f"{run['id']}  {run['status']:<10} {run['name']:<30} attempt {run['attempt']}  "
              f"{'' if p is None else f'{p * 100:.0f}%'}  ETA {_duration(run.get('eta_seconds'))}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    params: dict[str, Any] = {"tail": args.tail}
    if args.attempt:
        params["attempt"] = args.attempt
    page = _call("GET", f"/v1/runs/{args.id}/logs", params=params)
    for line in page["lines"]:
        print(line)
    while args.follow:
        time.sleep(1)
        page = _call("GET", f"/v1/runs/{args.id}/logs",
                     params={"since_offset": page["next_offset"], "attempt": page["attempt"]})
        for line in page["lines"]:
            print(line, flush=True)
        if not page["lines"] and _call("GET", f"/v1/runs/{args.id}")["status"] in TERMINAL:
            return 0
    return 0


def cmd_hosts(args: argparse.Namespace) -> int:
    if args.action == "add":
        body = {"name": args.name, "address": args.address, "port": args.port, "username": args.username,
                "key_path": args.key_path, "workspace": args.workspace, "python": args.python}
        if args.host_key:
            body["host_key"] = args.host_key
        _print(_call("POST", "/v1/hosts", json={k: v for k, v in body.items() if v is not None}))
    elif args.action == "gpus":
        _print(_call("GET", f"/v1/hosts/{args.name}/gpus"))
    else:
        for h in _call("GET", "/v1/hosts"):
            state = {True: "reachable", False: "UNREACHABLE", None: "not contacted yet"}[h["reachable"]]
            print(f"{h['name']:<16} {h['address']}:{h['port']:<6} {h['workspace']}  {state}")
    return 0


def _settings_and_db() -> tuple[Settings, Any]:
    from server.db import Database

    settings = Settings()
    db = Database(settings.resolved_database_url)
    db.migrate()
    return settings, db


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from server.api.app import create_app
    from server.hosts import ensure_local_host

    settings, db = _settings_and_db()
    with db.writing() as s:
        ensure_local_host(s, settings)
    supervisor = None
    if not args.no_worker:
        from worker.supervisor import Supervisor

        supervisor = Supervisor(db, settings)
    app = create_app(db, settings, on_startup=supervisor.start if supervisor else None,
                     on_shutdown=supervisor.stop if supervisor else None)
    uvicorn.run(app, host=args.host or settings.bind_host, port=args.port or settings.port, log_level="warning")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.supervisor import Supervisor

    settings, db = _settings_and_db()
    supervisor = Supervisor(db, settings)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stop())
    try:
        supervisor.serve()
    except KeyboardInterrupt:
        supervisor.stop()
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    settings, _ = _settings_and_db()
    print(f"database at {settings.resolved_database_url} is up to date")
    return 0


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
    s.set_defaults(func=lambda a: _print(_call(
        "POST", "/v1/runs", content=a.file.read_bytes(),
        headers={"Content-Type": "application/json",
                 **({"Idempotency-Key": a.idempotency_key} if a.idempotency_key else {})})) or 0)

    s = sub.add_parser("status", help="one run, or the newest runs")
    s.add_argument("id", nargs="?")
    s.add_argument("--json", action="store_true")
    s.add_argument("--limit", type=int, default=20)
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("watch", help="live progress until the run ends")
    s.add_argument("id")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--every", type=float, default=5.0, help="seconds between lines when not on a terminal")
    s.set_defaults(func=cmd_watch)

    s = sub.add_parser("cancel", help="stop a run and verify no process remains")
    s.add_argument("id")
    s.set_defaults(func=lambda a: _print(_call("POST", f"/v1/runs/{a.id}/cancel")) or 0)

    s = sub.add_parser("restart", help="relaunch as a new attempt, optionally with changed settings")
    s.add_argument("id")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. ttt_steps=5")
    s.add_argument("--clean", action="store_true", help="empty the output directory first")
    s.add_argument("--init-from-last", action="store_true", help="trainer runs: warm start from the last draft")
    s.add_argument("--dry-run", action="store_true", help="only predict the new attempt's duration")
    s.set_defaults(func=cmd_restart)

    s = sub.add_parser("logs", help="an attempt's log")
    s.add_argument("id")
    s.add_argument("-f", "--follow", action="store_true")
    s.add_argument("--tail", type=int, default=50)
    s.add_argument("--attempt", type=int)
    s.set_defaults(func=cmd_logs)

    s = sub.add_parser("hosts", help="list, add, or show the GPUs of hosts")
    s.add_argument("action", nargs="?", choices=["list", "add", "gpus"], default="list")
    s.add_argument("name", nargs="?")
    s.add_argument("--address")
    s.add_argument("--port", type=int, default=22)
    s.add_argument("--username")
    s.add_argument("--key-path")
    s.add_argument("--workspace")
    s.add_argument("--host-key")
    s.add_argument("--python")
    s.set_defaults(func=cmd_hosts)

    s = sub.add_parser("advise", help="depth advice from an evaluation file", add_help=False)
    s.set_defaults(func=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    daemon = bool(argv) and argv[0] in ("serve", "worker", "migrate")
    logging.basicConfig(level=os.environ.get("LONGRUN_LOG_LEVEL", "INFO" if daemon else "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "advise":
        from server.advice import advise_main

        return advise_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
