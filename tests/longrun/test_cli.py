"""The `longrun` command as a user types it: in this process against the API (no worker), and as a real
process against a real server. Every command's exit code and --json output are checked."""

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import typer
import yaml

from longrun.cli import app, main
from longrun.commands.service import configure_logging
from longrun.config import resolve
from longrun.exit_codes import ExitCode
from server.lifecycle import RunStatus as S
from server.models import LogChunk, Run
from tests.inprocess import App
from tests.service import ROOT, Service, free_port, toy_spec

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def longrun(service: Service, *args: str, expect: int = 0, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "longrun.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "LONGRUN_URL": service.url, **env})
    assert proc.returncode == expect, proc.stderr + proc.stdout
    return proc


def exit_code(argv: list[str]) -> int:
    """main's exit code: 0 is returned, anything else raised as SystemExit."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def walk(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from walk(sub, (*path, name))


def test_every_command_has_help_for_every_option_and_a_json_flag(capsys) -> None:
    root = typer.main.get_command(app)
    leaves = [(path, c) for path, c in walk(root) if path and not getattr(c, "commands", None)]
    assert len(leaves) >= 17
    for path, command in leaves:
        assert command.help, path
        for param in command.params:
            assert getattr(param, "help", None), (path, param.name)
        assert "--json" in [o for p in command.params for o in p.opts], path
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "Exit codes" in help_text and "--install-completion" in help_text
    for code in ExitCode:
        assert re.search(rf"^\W*{int(code)}\s", help_text, re.M), code


def complete(words: str, url: str) -> list[str]:
    """What bash completion offers after `words` (the shell hook that --install-completion installs)."""
    env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(len(words.split(" ")) - 1),
           "_LONGRUN_COMPLETE": "complete_bash", "LONGRUN_URL": url}
    done = subprocess.run([sys.executable, "-m", "longrun.cli"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_shell_completion_offers_commands_and_options() -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    assert complete("longrun hosts ", nowhere) == ["list", "add", "update", "remove", "show", "gpus", "probe-interconnect",
                                                   "probe-verifier"]
    assert complete("longrun restart x --st", nowhere) == ["--start"]  # its older spellings are not offered
    assert complete("longrun watch ", nowhere) == []  # run ids come from the server: none without one


def test_status_restart_and_hosts_as_text_and_json(cli: App, tmp_path: Path, capsys, monkeypatch) -> None:
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(yaml.safe_dump({"name": "toy", "host": "local", "entrypoint": "/opt/train.py",
                                         "args": ["--steps", "3"]}))
    assert main(["submit", str(spec_file), "--idempotency-key", "k", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert run["spec"]["args"] == ["--steps", "3"] and run["status"] == "queued"
    assert main(["submit", str(spec_file), "--idempotency-key", "k"]) == 0
    assert f"submitted {run['id']} (toy): queued" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO('{"name": "piped", "host": "local", "entrypoint": "/opt/t.py"}'))
    assert main(["submit", "-", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "piped"
    assert main(["status"]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"{run['id']}\s+toy\s+queued\s+local\s+1", table) and "piped" in table
    assert main(["status", "--json", "--state", "queued", "--limit", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out)["items"]) == 1
    assert main(["status", "--json", "--state", "running"]) == 0
    assert json.loads(capsys.readouterr().out)["items"] == []
    assert main(["status", run["id"]]) == 0
    detail = capsys.readouterr().out
    assert "queued  attempt 1  ETA —" in detail and re.search(r"^1\s+pending", detail, re.M)
    assert main(["status", run["id"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attempts"][0]["status"] == "pending"
    assert main(["hosts"]) == 0
    assert re.search(r"^local\s+local\s+\S+\s+not contacted yet", capsys.readouterr().out, re.M)
    assert main(["hosts", "list", "--json"]) == 0
    assert [h["name"] for h in json.loads(capsys.readouterr().out)] == ["local"]
    assert main(["hosts", "add", "box", "--address", "10.0.0.9", "--workspace", "/srv/lr", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["address"] == "10.0.0.9"
    assert main(["hosts", "show", "box", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workspace"] == "/srv/lr"
    assert main(["restart", run["id"], "--set", 'args=["--steps","5"]', "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_spec"]["args"] == ["--steps", "5"]
    assert main(["restart", run["id"], "--dry-run"]) == 0
    assert "the new attempt would take" in capsys.readouterr().out
    assert main(["cancel", run["id"], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "cancelling"


def test_refusals_usage_errors_and_their_exit_codes(cli: App, tmp_path: Path, capsys) -> None:
    assert exit_code(["status", "nope"]) == ExitCode.REFUSED
    assert "longrun: 404 no run with id 'nope'" in capsys.readouterr().err
    assert exit_code(["status", "nope", "--json"]) == ExitCode.REFUSED
    out = capsys.readouterr().out
    assert json.loads(out) == {"error": "404 no run with id 'nope' (nor one with that id prefix or name)",
                               "exit_code": 5, "status_code": 404}
    run = cli.submit()
    assert exit_code(["restart", run["id"], "--set", "colour=red"]) == ExitCode.REFUSED
    assert "longrun: 422 overrides.colour: unknown override" in capsys.readouterr().err
    assert exit_code(["restart", run["id"], "--set", "colour"]) == ExitCode.USAGE
    assert "--set takes KEY=VALUE" in capsys.readouterr().err
    assert exit_code(["cancel", run["id"]]) == 0
    assert exit_code(["cancel", run["id"]]) == ExitCode.REFUSED
    assert "only a queued, launching or running run" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    assert exit_code(["submit", str(bad)]) == ExitCode.USAGE
    assert "holds a list, not a run spec" in capsys.readouterr().err
    assert exit_code(["submit", str(tmp_path / "missing.json")]) == ExitCode.USAGE
    assert exit_code(["submit", str(bad), "--json"]) == ExitCode.USAGE
    assert json.loads(capsys.readouterr().out)["exit_code"] == 2
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps({"name": "toy", "host": "local", "entrypoint": "/opt/x.py", "nproc_per_node": 0}))
    assert exit_code(["submit", str(invalid)]) == ExitCode.REFUSED
    assert "nproc_per_node" in capsys.readouterr().err
    assert exit_code(["status", "--limit", "0"]) == ExitCode.USAGE
    assert exit_code(["nonsense"]) == ExitCode.USAGE
    assert exit_code(["hosts", "gpus", "local", "--wait", "0"]) == ExitCode.REFUSED
    assert "503 no GPU snapshot of local yet" in capsys.readouterr().err
    assert exit_code(["export", "nope", "--tensorboard", str(tmp_path / "tb"), "--json"]) == ExitCode.REFUSED
    assert json.loads(capsys.readouterr().out)["status_code"] == 404


def test_a_server_that_is_not_there_exits_4_and_says_how_to_start_one(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path, capsys) -> None:
    monkeypatch.setenv("LONGRUN_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("LONGRUN_URL", f"http://127.0.0.1:{free_port()}")
    assert exit_code(["status"]) == ExitCode.UNREACHABLE
    assert re.search(r"longrun: cannot reach the server at http://127.0.0.1:\d+ \(start it with `longrun serve`",
                     capsys.readouterr().err)
    assert exit_code(["hosts", "--json"]) == ExitCode.UNREACHABLE
    assert json.loads(capsys.readouterr().out)["exit_code"] == 4


@pytest.mark.parametrize(("ending", "code"), [(S.SUCCEEDED, ExitCode.OK), (S.FAILED, ExitCode.FAILED),
                                              (S.CANCELLING, ExitCode.CANCELLED)])
def test_watch_exits_with_the_runs_outcome(cli: App, capsys, ending: S, code: ExitCode) -> None:
    run = cli.submit()
    cli.move(run["id"], S.LAUNCHING, S.RUNNING, ending, *([S.CANCELLED] if ending == S.CANCELLING else []))
    assert exit_code(["watch", run["id"], "--json", "--interval", "0.05"]) == code
    snapshots = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert snapshots[-1]["status"] == ("cancelled" if ending == S.CANCELLING else ending.value)
    assert exit_code(["watch", run["id"], "--every", "0"]) == code
    assert f"{snapshots[-1]['status']} (attempt 1)" in capsys.readouterr().out


def later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()))
    thread.start()
    return thread


def test_cancel_wait_returns_once_the_run_is_cancelled(cli: App, capsys) -> None:
    run = cli.submit()
    cli.move(run["id"], S.LAUNCHING, S.RUNNING)
    cancelling_seen: list[float] = []

    def worker_ends_it() -> None:
        """As the worker does once nothing is left: cancelled, 0.5 s after the command's cancel was stored (a
        fixed delay from the start raced the command on a loaded machine: the move from running is refused, and
        the run stayed cancelling with nobody to end it)."""
        deadline = time.monotonic() + 120
        while cli.client.get(f"/v1/runs/{run['id']}").json()["status"] != "cancelling":
            assert time.monotonic() < deadline, "the command's cancel was never stored"
            time.sleep(0.02)
        cancelling_seen.append(time.time())
        time.sleep(0.5)
        cli.move(run["id"], S.CANCELLED)

    mover = later(0, worker_ends_it)
    assert exit_code(["cancel", run["id"], "--wait", "--interval", "0.05", "--json"]) == 0
    mover.join()
    assert cancelling_seen and time.time() - cancelling_seen[0] >= 0.5, "it waited for the run's end"
    assert json.loads(capsys.readouterr().out)["status"] == "cancelled"


def test_logs_take_node_and_attempt(cli: App, capsys) -> None:
    run = cli.submit()
    with cli.session() as s:
        s.add(LogChunk(run_id=run["id"], attempt=1, node=0, offset=0, end=12, text="first\nsecond\n"))
        s.add(LogChunk(run_id=run["id"], attempt=1, node=1, offset=0, end=10, text="node one\n"))
    assert main(["logs", run["id"], "--tail", "1"]) == 0
    assert capsys.readouterr().out == "second\n"
    assert main(["logs", run["id"], "--node", "1", "--attempt", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"attempt": 1, "node": 1, "line": "node one"}
    assert exit_code(["logs", run["id"], "--attempt", "2"]) == ExitCode.REFUSED


def test_config_file_env_and_flags_in_that_order(cli: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys) -> None:
    cli.settings.api_token = "s3cret"
    assert exit_code(["hosts"]) == ExitCode.REFUSED
    assert "401" in capsys.readouterr().err
    assert main(["config", "set", "token", "s3cret"]) == 0
    config = tmp_path / "config.toml"
    assert config.stat().st_mode & 0o777 == 0o600
    assert main(["hosts", "--json"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("LONGRUN_API_TOKEN", "wrong")
    assert exit_code(["hosts"]) == ExitCode.REFUSED
    assert main(["--token", "s3cret", "hosts"]) == 0
    capsys.readouterr()
    assert main(["--url", "http://elsewhere:9", "config", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == {"url": "http://elsewhere:9", "url_from": "flag", "token": "***", "token_from": "env",
                     "config_file": str(config)}
    monkeypatch.delenv("LONGRUN_API_TOKEN")
    assert main(["config", "set", "url", "http://from-file:8080", "--json"]) == 0
    capsys.readouterr()
    assert main(["config", "show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["url"], shown["url_from"], shown["token_from"]) == ("http://from-file:8080", str(config), str(config))
    assert main(["config", "unset", "url"]) == 0
    assert "url" not in config.read_text() and "s3cret" in config.read_text()
    assert exit_code(["config", "set", "colour", "red"]) == ExitCode.USAGE
    config.chmod(0o644)
    assert main(["config", "show"]) == 0
    assert f"{config} holds a token and others can read it: chmod 600" in capsys.readouterr().err


def test_the_config_files_url_is_the_one_dialled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    port = free_port()
    config = tmp_path / "config.toml"
    config.write_text(f'url = "http://127.0.0.1:{port}"\n')
    monkeypatch.setenv("LONGRUN_CONFIG", str(config))
    monkeypatch.delenv("LONGRUN_URL", raising=False)
    assert exit_code(["status"]) == ExitCode.UNREACHABLE
    assert f"http://127.0.0.1:{port}" in capsys.readouterr().err
    config.write_text("url = [broken\n")
    assert exit_code(["status"]) == ExitCode.USAGE
    assert "is not TOML" in capsys.readouterr().err


def test_advise_from_an_evaluation_file(tmp_path: Path) -> None:
    report = {"by_depth": [{"depth": d, "mean_accepted": 1 + sum([0.8, 0.6, 0.45, 0.3][:d])} for d in range(1, 5)],
              "position_acceptance": [0.8, 0.6, 0.45, 0.3]}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(report))
    out = subprocess.run([sys.executable, "-m", "longrun.cli", "advise", "--evaluation", str(path), "--interconnect",
                          "both", "--tp", "8", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    advice = json.loads(out.stdout)
    assert advice["pcie"]["recommended_depth"] >= advice["nvlink"]["recommended_depth"] >= 1
    bad = subprocess.run([sys.executable, "-m", "longrun.cli", "advise", "--evaluation", str(tmp_path / "no.json")],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == ExitCode.USAGE and "No such file" in bad.stderr


@pytest.mark.slow
def test_submit_watch_restart_logs_status_and_export(service: Service, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(yaml.safe_dump(toy_spec(steps=20, sleep=0.05, nproc=1)))
    watched = longrun(service, "submit", str(spec_file), "--watch", "--interval", "0.3", "--every", "0.5").stdout
    run_id = re.search(r"submitted (\w+) \(toy\)", watched).group(1)
    assert "succeeded (attempt 1)" in watched and "step 20/20" in watched and "ETA" in watched
    dry = json.loads(longrun(service, "restart", run_id, "--set", 'args=["--steps","10"]', "--dry-run",
                             "--json").stdout)
    assert dry["dry_run"] is True and dry["new_spec"]["args"] == ["--steps", "10"]
    lines = longrun(service, "restart", run_id, "--set", 'args=["--steps","10"]', "--watch", "--json",
                    "--interval", "0.3").stdout.splitlines()
    snapshots = [json.loads(line) for line in lines]
    assert snapshots[0]["attempt"] == 2 and snapshots[-1]["status"] == "succeeded"
    assert "step 10/10" in longrun(service, "logs", run_id, "--tail", "5").stdout
    first = [json.loads(line) for line in longrun(service, "logs", run_id, "--attempt", "1", "--json").stdout.splitlines()]
    assert {"attempt": 1, "node": 0, "line": "step 20/20 loss " + first[-1]["line"].split("loss ")[1]} == first[-1]
    assert complete(f"longrun logs {run_id[:3]}", service.url) == [run_id]
    status = json.loads(longrun(service, "status", run_id, "--json").stdout)
    assert [a["status"] for a in status["attempts"]] == ["succeeded", "succeeded"]
    assert run_id in longrun(service, "status").stdout
    assert "local" in longrun(service, "hosts").stdout

    exported = json.loads(longrun(service, "export", run_id, "--tensorboard", str(tmp_path / "tb"), "--json").stdout)
    assert exported["attempts"] == [1, 2] and exported["directory"] == str(tmp_path / "tb" / run_id)
    events = EventAccumulator(exported["directory"])
    events.Reload()
    loss = events.Scalars("train/loss")
    # attempt 2 started over at step 1: it comes after attempt 1's 20 steps
    assert [e.step for e in loss] == list(range(1, 31))
    assert [(e.step, e.value) for e in events.Scalars("longrun/attempt")] == [(1, 1.0), (21, 2.0)]
    series = service.series(run_id, "loss")
    assert [e.value for e in loss] == pytest.approx([p["value"] for p in series])


@pytest.mark.slow
def test_failed_and_cancelled_runs_and_logs_following_a_restart(service: Service, tmp_path: Path) -> None:
    failing = tmp_path / "fail.json"
    failing.write_text(json.dumps(toy_spec(steps=10, sleep=0.02, nproc=1, args=["--fail-at", "3"])))
    out = longrun(service, "submit", str(failing), "--watch", "--interval", "0.3", expect=ExitCode.FAILED).stdout
    assert "failed (attempt 1)" in out

    long_run = tmp_path / "long.json"
    long_run.write_text(json.dumps(toy_spec(steps=600, sleep=0.05, nproc=1)))
    run = json.loads(longrun(service, "submit", str(long_run), "--json").stdout)
    service.wait(run["id"], lambda r: (r["latest"].get("step") or 0) >= 1, what="a first step")
    follower = subprocess.Popen([sys.executable, "-m", "longrun.cli", "logs", run["id"], "-f", "--interval", "0.3",
                                 "--json"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                                env={**os.environ, "LONGRUN_URL": service.url})
    try:
        # unbuffered: a text pipe's readline would keep the lines that came with the first, out of communicate's reach
        first_line = follower.stdout.readline().decode()  # it follows attempt 1 before the restart
        longrun(service, "restart", run["id"], "--set", 'args=["--steps","5","--label","second"]')
        out, err = (b.decode() for b in follower.communicate(timeout=120))
    finally:
        follower.kill()
    assert follower.returncode == 0, err
    followed = [json.loads(line) for line in [first_line, *out.splitlines()]]
    assert followed[0]["attempt"] == 1 and followed[-1] == {"attempt": 2, "node": 0, "line": "step 5/5 loss "
                                                            + followed[-1]["line"].split("loss ")[1]}
    assert any(e["attempt"] == 2 and "second" in e["line"] for e in followed)

    longrun(service, "restart", run["id"], "--set", 'args=["--steps","600"]')
    service.wait(run["id"], lambda r: r["attempt"] == 3 and (r["latest"].get("step") or 0) >= 1, what="attempt 3")
    cancelled = json.loads(longrun(service, "cancel", run["id"], "--wait", "--json", "--interval", "0.2").stdout)
    assert cancelled["status"] == "cancelled"
    assert "cancelled (attempt 3)" in longrun(service, "watch", run["id"], expect=ExitCode.CANCELLED).stdout
    longrun(service, "logs", run["id"], "-f", expect=ExitCode.CANCELLED)


@pytest.mark.slow
def test_the_service_processes_log_json_lines_and_migrate_answers_json(tmp_path: Path) -> None:
    env = {**os.environ, "LONGRUN_HOME": str(tmp_path), "LONGRUN_LOG_LEVEL": "INFO"}
    env.pop("LONGRUN_DATABASE_URL", None)
    migrated = subprocess.run([sys.executable, "-m", "longrun.cli", "migrate", "--json"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
    assert migrated.returncode == 0, migrated.stderr
    assert json.loads(migrated.stdout)["up_to_date"] is True
    port = free_port()
    for argv in (["serve", "--json", "--port", str(port)], ["worker", "--json"]):
        proc = subprocess.Popen([sys.executable, "-m", "longrun.cli", *argv], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = []  # up to the worker's start: SIGTERM is handled from there on
            while not lines or not re.fullmatch(r"worker \S+ started", lines[-1]["message"]):
                lines.append(json.loads(proc.stderr.readline()))
                assert {"time", "level", "logger", "message"} <= lines[-1].keys(), lines[-1]
        finally:
            proc.terminate()
            proc.communicate(timeout=60)
        # uvicorn shuts down and then re-raises the SIGTERM it caught; the worker returns
        assert proc.returncode == (-signal.SIGTERM if argv[0] == "serve" else 0), argv


HOSTILE = ["[/]", "toy [/x] run", "[bold red]loud[/]", ":smile: [link=x]y"]


def test_names_workspaces_and_messages_that_read_like_markup_print_as_they_are(cli: App, capsys, monkeypatch) -> None:
    runs = [cli.submit(name=name) for name in HOSTILE]
    assert main(["hosts", "add", "odd", "--address", "10.0.0.9", "--workspace", "/srv/[/]/[bold]ws"]) == 0
    assert "workspace /srv/[/]/[bold]ws" in capsys.readouterr().out
    cli.move(runs[0]["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    with cli.session() as s:
        s.get(Run, runs[0]["id"]).message = "[/] the job said [red]no[/red]"
    assert main(["status"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in HOSTILE[:2]), table
    for run, name in zip(runs, HOSTILE, strict=True):
        assert main(["status", run["id"]]) == 0
        assert f"{name} [{run['id']}]" in capsys.readouterr().out
    assert main(["hosts"]) == 0
    assert "/srv/[/]/[bold]ws" in capsys.readouterr().out
    assert main(["hosts", "show", "odd"]) == 0
    assert "/srv/[/]/[bold]ws" in capsys.readouterr().out
    monkeypatch.setenv("FORCE_COLOR", "1")  # the watch panel, as on a terminal
    assert exit_code(["watch", runs[0]["id"], "--interval", "0.05"]) == ExitCode.FAILED
    shown = ANSI.sub("", capsys.readouterr().out)
    assert f"[/] [{runs[0]['id']}]" in shown and "the job said [red]no[/red]" in shown
    assert exit_code(["watch", runs[0]["id"], "--every", "0"]) == ExitCode.FAILED
    assert "the job said [red]no[/red]" in capsys.readouterr().out


@pytest.mark.parametrize("token", ["s3cret-\U0001F511-\U00020000", 'q"uote\\back\ttab', "del\x7fnul\x00esc\x1b"])
def test_setting_a_token_leaves_the_config_owner_only_and_readable_whatever_the_token(
        cli: App, tmp_path: Path, capsys, token: str) -> None:
    config = tmp_path / "config.toml"
    config.write_text('url = "http://127.0.0.1"\n')
    config.chmod(0o644)  # an existing file others may read, as an editor or an older longrun left it
    assert main(["config", "set", "token", token]) == 0
    assert config.stat().st_mode & 0o777 == 0o600
    assert resolve().token == token, "read back as it was set"
    capsys.readouterr()
    assert main(["config", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_from"] == str(config)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".config")] == []


def test_a_host_field_holding_line_breaks_cannot_forge_a_line_of_the_service_log(capsys) -> None:
    address = "10.0.0.9\n2026-12-02 12:00:00,000 INFO longrun.worker: run r1 succeeded\r\x1b[2K\u2028x"
    configure_logging(as_json=False)
    try:
        log = logging.getLogger("longrun.worker")
        log.warning("run %s: host unreachable: %s", "r1", f"ssh to {address}: timed out")  # as run_driver says it
        try:
            raise OSError(f"cannot reach {address}")
        except OSError:
            log.exception("host %s: not connected", address)
    finally:
        logging.basicConfig(force=True, handlers=[logging.NullHandler()])
    lines = capsys.readouterr().err.splitlines()
    records = [line for line in lines if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", line)]
    assert len(records) == 2 and "succeeded" not in "".join(r.split(": ", 1)[0] for r in records), lines
    assert "10.0.0.9\\n2026-12-02" in records[0] and "\\r\\x1b[2K\\u2028x" in records[0]
    assert all(line.startswith("    ") for line in lines if line not in records), "the traceback stays indented"
