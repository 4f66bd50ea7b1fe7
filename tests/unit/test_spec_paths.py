"""A spec file's relative paths, resolved by the command: what the trainer reads beside the file on the `local`
host (elsewhere under the host's workspace), what the job writes under the host's workspace."""

from pathlib import Path

import pytest

from longrun.specs import SpecError, read_spec, resolve_paths

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


def test_a_path_whose_dotdot_climbs_out_of_the_workspace_is_named_as_such_and_tilde_is_left_to_the_server() -> None:
    spec = {"host": "gpu-box", "trainer": {"output_dir": "../../etc"}}
    with pytest.raises(SpecError) as refused:
        resolve_paths(spec, "-", lambda host: "/ws")
    said = str(refused.value)
    assert said.startswith("trainer.output_dir: ../../etc climbs out of the workspace /ws of host gpu-box with '..'")
    assert "(to /etc)" in said and "absolute path" not in said
    inside = {"host": "gpu-box", "trainer": {"output_dir": "runs/../out", "data_dir": "~/d"}}
    assert resolve_paths(inside, "-", lambda host: "/ws") == ["trainer.output_dir: runs/../out -> /ws/out"]
    assert inside["trainer"]["data_dir"] == "~/d"


def test_a_relative_entrypoint_is_resolved_as_the_trainers_paths_are(tmp_path: Path) -> None:
    local = {"host": "local", "entrypoint": "train.py", "args": []}
    said = resolve_paths(local, str(tmp_path / "run.yaml"), lambda host: "/home/u/ws")
    assert local["entrypoint"] == str(tmp_path / "train.py") and said == [f"entrypoint: train.py -> {tmp_path}/train.py"]
    remote = {"host": "gpu-box", "entrypoint": "jobs/train.py"}
    resolve_paths(remote, str(tmp_path / "run.yaml"), lambda host: f"/ws-of-{host}")
    assert remote["entrypoint"] == "/ws-of-gpu-box/jobs/train.py"
