"""A name, a host field, a message or a log line holding terminal control (clear the screen, set the window title,
write the clipboard with OSC 52) is refused at the API where it is a name, and never reaches the terminal from the
command, whatever was stored before that rule."""

import re

import pytest

from longrun.cli import main
from server.lifecycle import RunStatus as S
from server.models import Attempt, Host, LogChunk, Run
from tests.inprocess import App

# clear the screen, set the title, write the clipboard, an 8-bit CSI, a carriage return, a bell
HOSTILE = "\x1b[2J\x1b]0;T\x07\x1b]52;c;QUFBQQ==\x07evil\x9b31m\rname\x07"
# what the terminal must not get: ESC (the panel's own colours aside), the C1 CSI and OSC, BEL, CR
OBEYED = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
OWN_COLOURS = re.compile(r"\x1b\[[0-9;]*m")  # rich's SGR codes, on a terminal only


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_names_and_addresses_holding_control_characters_are_refused_naming_the_field(cli: App) -> None:
    base = {"host": "local", "entrypoint": "/opt/train.py"}
    for body, field in [({**base, "name": HOSTILE}, ["body", "name"]),
                        ({**base, "name": "tab\there"}, ["body", "name"]),
                        ({"name": "ok", "hosts": ["local", "b\x1b]0;x\x07"], "entrypoint": "/opt/train.py"},
                         ["body", "hosts", 1])]:
        r = cli.client.post("/v1/runs", json=body)
        assert r.status_code == 422, r.text
        assert [e["loc"] for e in r.json()["detail"]] == [field], r.text
        assert "control characters" in r.json()["detail"][0]["msg"]
    host = {"name": "box", "address": "10.0.0.9\x1b[2J", "workspace": "/srv/ws"}
    r = cli.client.post("/v1/hosts", json=host)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "address"], r.text
    r = cli.client.patch("/v1/hosts/local", json={"username": "ml\x9b2J"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "username"], r.text
    assert cli.client.post("/v1/runs", json={**base, "name": "plain name [ok] ü"}).status_code == 201


@pytest.fixture
def stored(cli: App) -> dict:
    """A run, its attempt, a host and a log line holding HOSTILE, stored as an older server let them in."""
    run = cli.submit(name="placeholder")
    cli.move(run["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    with cli.session() as s:
        row = s.get(Run, run["id"])
        row.name, row.message = HOSTILE, f"failed: {HOSTILE}"
        s.query(Attempt).filter_by(run_id=run["id"]).update({"message": f"attempt said {HOSTILE}"})
        s.add(Host(name=f"h{HOSTILE}", address=f"10.0.0.9{HOSTILE}", port=22, workspace=f"/srv/{HOSTILE}",
                   python="python3"))
        line = f"step 1 {HOSTILE}\n"
        s.add(LogChunk(run_id=run["id"], attempt=1, node=0, offset=0, end=len(line.encode()), text=line))
    return run


def assert_shown_as_text(out: str, colours: bool = False) -> None:
    shown = OWN_COLOURS.sub("", out) if colours else out
    assert not OBEYED.search(shown), repr(out)
    assert "evil" in shown and "name" in shown, "the printable part stays"


def test_strings_stored_with_terminal_controls_print_as_text_in_every_view(stored: dict, capsys, monkeypatch) -> None:
    run_id = stored["id"]
    for argv in (["status"], ["status", run_id], ["hosts"], ["logs", run_id]):
        assert main(argv) == 0, argv
        assert_shown_as_text(capsys.readouterr().out)
    assert exit_code(["watch", run_id, "--every", "0"]) == 1  # lines, as to a pipe
    assert_shown_as_text(capsys.readouterr().out)
    monkeypatch.setenv("FORCE_COLOR", "1")  # the panel and the tables as on a terminal
    for argv in (["status"], ["status", run_id], ["hosts"]):
        assert main(argv) == 0, argv
        assert_shown_as_text(capsys.readouterr().out, colours=True)
    assert exit_code(["watch", run_id, "--interval", "0.05"]) == 1
    out = capsys.readouterr().out
    assert "\x1b]" not in out and "\x07" not in out and "\x1b[2J" not in out, repr(out)


def test_logs_raw_prints_a_jobs_line_as_it_wrote_it(stored: dict, capsys) -> None:
    assert main(["logs", stored["id"], "--raw"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 1 \x1b[2J\x1b]0;T\x07\x1b]52;c;QUFBQQ==\x07evil"), repr(out)


def test_an_error_quoting_a_stored_name_prints_as_text(cli: App, capsys) -> None:
    run = cli.submit(name="placeholder")
    cli.move(run["id"], S.LAUNCHING, S.RUNNING)
    with cli.session() as s:
        s.get(Run, run["id"]).name = HOSTILE
    assert exit_code(["hosts", "remove", "local", "--yes"]) != 0  # refused: the run uses it, and the 409 names it
    err = capsys.readouterr().err
    assert "evil" in err and not OBEYED.search(err.rstrip("\n")), repr(err)
