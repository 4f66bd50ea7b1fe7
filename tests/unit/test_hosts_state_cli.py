"""`hosts add`, `hosts update` and `hosts show` say in text what --json says: the host's state, and when the worker
could not reach it, why and the line that fixes it. In-process, the API without the worker."""

from pathlib import Path

from longrun.cli import main
from server.models import Host
from tests.inprocess import App

REFUSED = ("host 10.0.0.9 presented an unknown host key (ssh-ed25519 SHA256:abc); refusing to connect. If you trust "
           'it, pin it with: longrun hosts update box --host-key "ssh-ed25519 AAAAC3Nz"')


def test_an_unreachable_hosts_reason_and_fix_show_in_text(cli: App, tmp_path: Path, capsys) -> None:
    assert main(["hosts", "add", "box", "--address", "10.0.0.9", "--workspace", "/srv/lr"]) == 0
    added = capsys.readouterr().out
    assert "added box (10.0.0.9, workspace /srv/lr)" in added  # port 22 yields to an SSH config's Port
    assert "box has not been contacted yet" in added
    with cli.session() as s:  # what the worker stores when the host's key is refused
        host = s.query(Host).filter_by(name="box").one()
        host.reachable, host.last_error = False, REFUSED
    assert main(["hosts", "show", "box"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "box is UNREACHABLE: host 10.0.0.9 presented an unknown host key" in shown
    assert 'longrun hosts update box --host-key "ssh-ed25519 AAAAC3Nz"' in shown
    assert main(["hosts", "update", "box", "--port", "2222"]) == 0
    updated = " ".join(capsys.readouterr().out.split())
    assert "updated box: port" in updated and "box has not been contacted yet" in updated
    assert main(["hosts", "show", "box"]) == 0
    assert "10.0.0.9:2222" in capsys.readouterr().out
