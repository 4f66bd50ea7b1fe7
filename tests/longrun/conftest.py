from pathlib import Path

import pytest

from longrun import Client
from tests.inprocess import App


@pytest.fixture
def cli(api: App, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> App:
    """`longrun` commands in this process, talking to the in-process API (no worker); no config file."""
    monkeypatch.setattr("longrun.commands.common.Client",
                        lambda url=None, token=None: Client(api.client.base_url, token=token, http=api.client))
    monkeypatch.setenv("LONGRUN_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.delenv("LONGRUN_API_TOKEN", raising=False)
    return api
