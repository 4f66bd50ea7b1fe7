"""The client reads a run's metrics whole though the server answers at most 20,000 points at a time: it follows
next_cursor (what `longrun export` reads through), up to the limit it was given."""

from datetime import UTC, datetime

import pytest

from longrun import Client
from server.models import MetricPoint
from tests.inprocess import App

pytestmark = pytest.mark.sqlite_only


def test_the_client_follows_the_pages_to_every_point_up_to_its_limit(api: App) -> None:
    run = api.submit()
    now = datetime.now(UTC)
    with api.session() as s:
        s.execute(MetricPoint.__table__.insert(), [
            {"run_id": run["id"], "attempt": 1, "line": i, "name": name, "step": i, "value": i / 7, "time": now}
            for name in ("acc_0", "loss") for i in range(22_500)])
    client = Client(api.client.base_url, http=api.client)
    series = client.metrics(run["id"], limit=1_000_000)
    assert {name: [p["step"] for p in points] for name, points in series.items()} == {
        "acc_0": list(range(22_500)), "loss": list(range(22_500))}
    some = client.metrics(run["id"], limit=30_000)
    assert [len(p) for p in some.values()] == [22_500, 7_500]
    thinned = client.metrics(run["id"], names=["loss"])
    assert len(thinned["loss"]) <= 2000 and thinned["loss"][-1]["step"] == 22_499
