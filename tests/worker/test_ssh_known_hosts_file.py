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
