from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.inprocess import App


@pytest.fixture
def api(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    app = App(tmp_path / "home", tmp_path_factory.getbasetemp())
    yield app
    app.close()
