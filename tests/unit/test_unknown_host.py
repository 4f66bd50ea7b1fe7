"""An unknown host is refused with the command that registers it, from the API and from `longrun submit` of the
example spec (whose host, gpu-box, a fresh server does not have)."""

from pathlib import Path

from tests.inprocess import App
from tests.longrun.test_cli import exit_code

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "eagle3-ttt3.yaml"


def test_a_spec_naming_an_unknown_host_names_longrun_hosts_add(api: App) -> None:
    refused = api.client.post("/v1/runs", json={"name": "x", "host": "gpu-box", "nproc_per_node": 1,
                                                "entrypoint": "/ws/train.py"})
    assert refused.status_code == 422
    [error] = refused.json()["detail"]
    assert error["loc"] == ["body", "host"]
    assert "register it with `longrun hosts add gpu-box --address ADDRESS" in error["msg"], error["msg"]


def test_submitting_the_example_spec_before_its_host_is_registered_says_how(cli: App, capsys) -> None:
    assert exit_code(["submit", str(EXAMPLE)]) == 5
    err = " ".join(capsys.readouterr().err.split())
    assert "no host named 'gpu-box': register it with `longrun hosts add gpu-box" in err, err
    assert "POST /v1/hosts" in err and "`longrun hosts list`" in err
