"""A spec file's relative paths, resolved by the command: what the trainer reads beside the file on the `local`
host (elsewhere under the host's workspace), what the job writes under the host's workspace."""

from pathlib import Path

from longrun.specs import read_spec, resolve_paths

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_local_example_resolves_beside_its_file_and_writes_under_the_workspace() -> None:
    spec = read_spec(str(EXAMPLES / "local-ttt3.yaml"))
    asked = []
    said = resolve_paths(spec, str(EXAMPLES / "local-ttt3.yaml"), lambda host: asked.append(host) or "/home/u/ws")
    clone = EXAMPLES.parent
    assert spec["trainer"]["verifier_path"] == str(clone / ".demo" / "verifier")
    assert spec["trainer"]["data_dir"] == str(clone / ".demo" / "data" / "hidden_states")
    assert spec["trainer"]["output_dir"] == "/home/u/ws/local-ttt3"
    assert asked == ["local"] and len(said) == 4 and said[-1] == "trainer.output_dir: local-ttt3 -> /home/u/ws/local-ttt3"


def test_on_another_host_every_relative_path_is_under_its_workspace_and_absolute_ones_stay() -> None:
    spec = {"host": "gpu-box", "trainer": {"verifier_path": "models/v", "data_dir": "/data/hs", "output_dir": "out"},
            "output_dir": None}
    resolve_paths(spec, "/somewhere/spec.yaml", lambda host: f"/ws-of-{host}")
    assert spec["trainer"] == {"verifier_path": "/ws-of-gpu-box/models/v", "data_dir": "/data/hs",
                               "output_dir": "/ws-of-gpu-box/out"}


def test_a_path_with_dotdot_or_tilde_is_left_for_the_server_to_refuse() -> None:
    spec = {"host": "gpu-box", "trainer": {"output_dir": "../escape", "data_dir": "~/d"}}
    assert resolve_paths(spec, "-", lambda host: "/ws") == []
    assert spec["trainer"] == {"output_dir": "../escape", "data_dir": "~/d"}
