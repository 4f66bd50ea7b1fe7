"""Look-alike names: a name or address holding an invisible format character (a zero-width space after `train`, a
bidi override) is refused with a 422 naming the field; whatever was stored before that rule, and any job's log
line, the command prints with those characters made visible (`<U+202E>`)."""

import sys
import unicodedata

from longrun import safe_text
from longrun.cli import main
from longrun.safe_text import clean
from server.lifecycle import RunStatus as S
from server.models import Host, LogChunk, Run
from tests.inprocess import App

OVERRIDE, ZERO_WIDTH = "\u202e", "\u200b"


def test_a_look_alike_name_is_refused_naming_the_field(cli: App) -> None:
    base = {"host": "local", "entrypoint": "/opt/train.py"}
    assert cli.client.post("/v1/runs", json={**base, "name": "train"}).status_code == 201
    for body, field, char in [({**base, "name": "train" + ZERO_WIDTH}, ["body", "name"], "U+200B ZERO WIDTH SPACE"),
                              ({**base, "name": f"report{OVERRIDE}txt.exe"}, ["body", "name"], "U+202E"),
                              ({**base, "name": "ok", "hosts": ["local", "b\u2066x"]}, ["body", "hosts", 1], "U+2066"),
                              ({**base, "name": "\ufefftrain"}, ["body", "name"], "U+FEFF")]:
        r = cli.client.post("/v1/runs", json=body, params={"name_suffix": "true"})
        assert r.status_code == 422, r.text
        assert [e["loc"] for e in r.json()["detail"]] == [field], r.text
        assert "invisible format characters" in r.text and char in r.text
    r = cli.client.post("/v1/hosts", json={"name": "box", "address": f"10.0.0.9{OVERRIDE}", "workspace": "/srv/ws"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "address"], r.text
    assert [run["name"] for run in cli.client.get("/v1/runs").json()["items"]] == ["train"]
    assert cli.client.post("/v1/runs", json={**base, "name": "نموذج train ü"}).status_code == 201, "scripts are names"


def test_stored_names_and_log_lines_with_bidi_and_zero_width_characters_print_them_visibly(cli: App, capsys) -> None:
    run = cli.submit(name="placeholder")
    cli.move(run["id"], S.LAUNCHING, S.RUNNING)
    with cli.session() as s:
        s.get(Run, run["id"]).name = f"train{ZERO_WIDTH}{OVERRIDE}gpj.exe"
        s.add(Host(name="h", address=f"10.0.0.9{OVERRIDE}", port=22, workspace="/srv/ws", python="python3"))
        line = f"step 1 {OVERRIDE}ssol 2.0\n"
        s.add(LogChunk(run_id=run["id"], attempt=1, node=0, offset=0, end=len(line.encode()), text=line))
    for argv, shown in ((["status"], "train<U+200B><U+202E>"), (["status", run["id"]], "train<U+200B><U+202E>gpj"),
                        (["hosts"], "10.0.0.9<U+202E>"), (["logs", run["id"]], "step 1 <U+202E>ssol 2.0")):
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        assert shown in out and OVERRIDE not in out and ZERO_WIDTH not in out, (argv, out)


def test_every_format_character_of_this_python_is_made_visible() -> None:
    hidden = [chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) in ("Cf", "Zl", "Zp")]
    assert all(safe_text.FORMAT.fullmatch(c) for c in hidden), [f"U+{ord(c):04X}" for c in hidden if not safe_text.FORMAT.fullmatch(c)]
    assert clean("a\u2028b") == "a<U+2028>b" and clean("plain ü نموذج") == "plain ü نموذج"
