"""An alias of ~/.ssh/config whose host key is in the file its `UserKnownHostsFile` names is reached, as OpenSSH
reaches it; a key in neither that file nor the one given is refused, and the fix names the config's file."""

import pytest

from tests.sshd import SshServer
from worker.host_errors import HostKeyRefused
from worker.ssh_transport import SSHTransport

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sshd():
    with SshServer() as server:
        yield server


def config_for(tmp_path, sshd, known: str) -> str:
    config = tmp_path / "ssh_config"
    config.write_text(f"""\
Host gpu-box
    HostName {sshd.address}
    Port {sshd.port}
    User {sshd.username}
    IdentityFile {sshd.client_key_path}
    UserKnownHostsFile {known} {tmp_path / "absent_known_hosts"}
""")
    return str(config)


def test_the_configs_user_known_hosts_file_holds_the_key_that_is_trusted(tmp_path, sshd) -> None:
    known = tmp_path / "team_known_hosts"
    known.write_text(sshd.known_hosts_line + "\n")
    t = SSHTransport("gpu-box", ssh_config=config_for(tmp_path, sshd, str(known)), connect_timeout=5)
    try:
        assert t.port == sshd.port and t.known_hosts == str(known)
        assert t.exec("echo reached").stdout == "reached\n"
    finally:
        t.close()


def test_a_key_missing_from_the_configs_file_is_refused_naming_that_file_in_the_fix(tmp_path, sshd) -> None:
    known = tmp_path / "team_known_hosts"
    known.write_text("")
    t = SSHTransport("gpu-box", ssh_config=config_for(tmp_path, sshd, str(known)), connect_timeout=3)
    with pytest.raises(HostKeyRefused, match=f">> {known}"):
        t.exec("true")
    t.close()


def test_a_host_registered_by_its_alias_shows_where_the_worker_reached_it(tmp_path, sshd) -> None:
    """`--address gpu-box` on port 22 yields to the alias's Port in the worker's ~/.ssh/config: once reached, the host
    says where (user@address:port), and `longrun hosts` shows it, not a `gpu-box:22` the worker never dials."""
    import subprocess
    import sys
    import time

    from tests.service import ROOT, Service

    known = tmp_path / "team_known_hosts"
    known.write_text(sshd.known_hosts_line + "\n")
    svc = Service(tmp_path / "home", ssh_config=config_for(tmp_path, sshd, str(known)))
    svc.home.mkdir()
    svc.start()
    try:
        workspace = tmp_path / "ws"
        workspace.mkdir()
        r = svc.client.post("/v1/hosts", json={"name": "box", "address": "gpu-box", "workspace": str(workspace),
                                               "python": sys.executable})
        assert r.status_code == 201, r.text
        deadline = time.time() + 60
        while (host := svc.client.get("/v1/hosts/box").json())["reached"] is None and time.time() < deadline:
            time.sleep(0.2)
        assert host["reached"] == f"{sshd.username}@{sshd.address}:{sshd.port}", host
        shown = subprocess.run([sys.executable, "-m", "longrun.cli", "hosts"], env={**svc.env,
                               "LONGRUN_URL": svc.url}, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert f"gpu-box -> {sshd.username}@{sshd.address}:{sshd.port}" in shown.stdout, shown.stdout + shown.stderr
        assert "gpu-box:22" not in shown.stdout
    finally:
        svc.stop()
