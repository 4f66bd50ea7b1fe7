"""`longrun submit` of a name a live run has is refused naming it, or suffixed with --name-suffix; a name that
names several ended runs picks the newest and says so on stderr. In-process, the API without the worker."""

import json
from pathlib import Path

import pytest
import yaml

from longrun.cli import main
from longrun.exit_codes import ExitCode
from server.lifecycle import RunStatus as S
from tests.inprocess import App


def test_a_live_name_is_refused_or_suffixed_and_an_ended_name_resolves_to_its_newest_run_with_a_note(
        cli: App, tmp_path: Path, capsys) -> None:
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(yaml.safe_dump({"name": "sweep", "host": "local", "entrypoint": "/opt/train.py"}))
    assert main(["submit", str(spec_file), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    with pytest.raises(SystemExit) as refusal:
        main(["submit", str(spec_file)])
    assert refusal.value.code == ExitCode.REFUSED
    refused = capsys.readouterr().err
    assert f"a run named 'sweep' is live: {first['id']}" in refused and "--name-suffix" in refused
    assert main(["submit", str(spec_file), "--name-suffix", "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["name"] == "sweep-2"
    # once ended, the name is free; among its ended runs, the newest is the one meant, and stderr says so
    cli.move(first["id"], S.LAUNCHING, S.RUNNING, S.FAILED)
    assert main(["submit", str(spec_file), "--json"]) == 0
    third = json.loads(capsys.readouterr().out)
    cli.move(third["id"], S.LAUNCHING, S.RUNNING, S.SUCCEEDED)
    assert main(["status", "sweep", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["id"] == third["id"]
    assert f"note: 'sweep' names 2 ended runs: this is the newest, {third['id']} (succeeded" in err
    assert first["id"] in err
