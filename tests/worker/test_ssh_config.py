"""SSH hosts as users reach them: an alias of ~/.ssh/config with HostName, User, Port, IdentityFile and a
ProxyJump bastion; the target is a real sshd that only the bastion's network namespace can reach."""

import pytest

from tests.netns import NetNamespace
from tests.sshd import SshServer
from worker.host_errors import HostKeyRefused, HostUnreachable
from worker.ssh_transport import SSHTransport

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bastion_and_box():
    with NetNamespace() as ns, SshServer(netns=ns) as bastion, \
            SshServer(netns=ns, ns_loopback=True, port=2223) as box:
        yield ns, bastion, box


def write_config(tmp_path, ns, bastion, box, jump="bastion"):
    config = tmp_path / "ssh_config"
    config.write_text(f"""\
Host gpu-box
    HostName 127.0.0.1
    Port {box.port}
    User {box.username}
    IdentityFile {box.client_key_path}
    ProxyJump {jump}

Host bastion
    HostName {ns.address}
    Port {bastion.port}
    User {bastion.username}
    IdentityFile {bastion.client_key_path}
""")
    known = tmp_path / "known_hosts"
    known.write_text(f"{bastion.known_hosts_line}\n[127.0.0.1]:{box.port} {' '.join(box.host_key_line.split()[:2])}\n")
    return str(config), str(known)


def test_an_alias_with_a_proxyjump_reaches_a_host_only_the_bastion_sees(tmp_path, bastion_and_box):
    ns, bastion, box = bastion_and_box
    config, known = write_config(tmp_path, ns, bastion, box)
    # the box listens on its namespace's loopback: straight from here there is nothing to connect to
    direct = SSHTransport("127.0.0.1", box.port, key_path=box.client_key_path, host_key=box.host_key_line,
                          ssh_config="", connect_timeout=1)
    with pytest.raises(HostUnreachable):
        direct.exec("true")
    t = SSHTransport("gpu-box", ssh_config=config, known_hosts=known, connect_timeout=5)
    try:
        assert (t.address, t.port, t.proxy_jump) == ("127.0.0.1", box.port, "bastion")
        # the box's sshd sees the connection come from inside the namespace
        result = t.exec("echo $SSH_CONNECTION")
        assert result.returncode == 0
        assert result.stdout.split()[0] == "127.0.0.1"
        # one connection serves every command, hops included
        assert t.exec("echo again").stdout == "again\n"
        assert len(bastion.session_pids()) == 1
    finally:
        t.close()


def test_a_jump_host_with_an_unknown_key_is_refused_with_how_to_trust_it(tmp_path, bastion_and_box):
    ns, bastion, box = bastion_and_box
    config, known = write_config(tmp_path, ns, bastion, box)
    with open(known, "w") as f:  # the box is known, the bastion is not
        f.write(f"[127.0.0.1]:{box.port} {' '.join(box.host_key_line.split()[:2])}\n")
    t = SSHTransport("gpu-box", ssh_config=config, known_hosts=known, connect_timeout=3)
    with pytest.raises(HostKeyRefused, match="ssh-keyscan"):
        t.exec("true")
    t.close()


def test_the_registration_wins_over_the_config_but_port_22_yields(tmp_path, bastion_and_box):
    ns, bastion, box = bastion_and_box
    config, known = write_config(tmp_path, ns, bastion, box)
    t = SSHTransport("bastion", 22, username="someone", ssh_config=config, known_hosts=known)
    assert (t.address, t.port, t.username, t.key_path) == (ns.address, bastion.port, "someone",
                                                           bastion.client_key_path)
    assert SSHTransport("bastion", 2299, ssh_config=config).port == 2299
    assert SSHTransport("elsewhere", ssh_config=config).address == "elsewhere"
