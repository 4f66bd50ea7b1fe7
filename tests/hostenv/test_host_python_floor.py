"""A host whose python cannot run the agent is told so in one sentence naming the version found and the floor (or
the module it lacks), never with a traceback or 'not a JSON object'."""

import sys
from pathlib import Path

import pytest

from tests.hostenv.test_host_env_matrix import host_python
from worker.host_agent import HostAgent, PythonUnfit
from worker.local_transport import LocalTransport


def _resolve(python: str, tmp_path: Path) -> str:
    return HostAgent(LocalTransport(), str(tmp_path / "ws ś"), python).workspace_real()


@pytest.mark.parametrize("version", ["2.7", "3.6"])
def test_a_python_below_the_floor_is_refused_naming_its_version_and_the_floor(version: str, tmp_path: Path) -> None:
    old = next(Path("/root/.pyenv/versions").glob(f"{version}.*/bin/python{version}"), None)
    if old is None:
        pytest.fail(f"no Python {version} on this machine (pyenv install {version}) for the floor test")
    with pytest.raises(PythonUnfit, match=rf"is Python {version}\.\d+; the agent needs Python 3\.8 or newer") as exc:
        _resolve(str(old), tmp_path)
    assert "Traceback" not in str(exc.value) and "--python" in str(exc.value)


def test_a_python_that_is_not_there_is_refused_saying_so(tmp_path: Path) -> None:
    with pytest.raises(PythonUnfit, match="did not run on the host .*--python naming a Python 3.8 or newer"):
        _resolve(str(tmp_path / "no-such-python3"), tmp_path)


def test_a_python_without_a_module_the_agent_needs_is_refused_naming_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "hashlib.py").write_text("raise ImportError('built without OpenSSL')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken))
    with pytest.raises(PythonUnfit, match="lacks the standard module 'hashlib'"):
        _resolve(sys.executable, tmp_path)


def test_the_floor_itself_resolves_the_workspace(tmp_path: Path) -> None:
    (tmp_path / "ws ś").mkdir()
    assert _resolve(host_python("3.8"), tmp_path) == str(tmp_path / "ws ś")


def _refused_python(service, tmp_path: Path, name: str, python: str) -> str:
    """Register `name` over a real sshd with `python`: a 422 at body.python, nothing registered, nothing written in
    the workspace; its message."""
    from tests.sshd import SshServer

    workspace = tmp_path / "ws"
    workspace.mkdir()
    with SshServer() as sshd:
        body = {"name": name, **sshd.host_fields, "workspace": str(workspace), "python": python}
        refused = service.client.post("/v1/hosts", json=body)
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert [e["loc"] for e in detail] == [["body", "python"]], detail
    assert "Traceback" not in refused.text
    assert service.client.get(f"/v1/hosts/{name}").status_code == 404
    assert list(workspace.iterdir()) == [], "nothing written on the host"
    return detail[0]["msg"]


def test_registering_a_host_whose_python_is_below_the_floor_is_refused_naming_python(service, tmp_path: Path) -> None:
    """Over a real sshd: the worker asks the host, and registration answers 422 at body.python with the version
    found and the floor; nothing is registered, and nothing is written in the workspace."""
    old = next(Path("/root/.pyenv/versions").glob("3.6.*/bin/python3.6"), None)
    if old is None:
        pytest.fail("no Python 3.6 on this machine (pyenv install 3.6) for the registration floor test")
    said = _refused_python(service, tmp_path, "old-box", str(old))
    assert "is Python 3.6." in said and "needs Python 3.8 or newer" in said and "JSON" not in said


def test_registering_a_host_whose_python_prints_junk_and_exits_1_is_refused_naming_python(
        service, tmp_path: Path) -> None:
    """Over a real sshd: a `python` that answers with junk (a wrapper script gone wrong, a shim that prints a
    banner and fails) is a 422 at body.python at registration, not a 201 and a run that fails at its launch."""
    junk = tmp_path / "junk-python"
    junk.write_text("#!/bin/sh\necho 'pyenv: python3.99: command not found, NOT JSON {'\nexit 1\n")
    junk.chmod(0o755)
    said = _refused_python(service, tmp_path, "junk-box", str(junk))
    assert "did not answer as a Python" in said and "NOT JSON" in said
