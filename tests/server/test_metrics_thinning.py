"""A run of many stored points reads in a moment (docs/reliability.md, "a run of a million points"): the metrics
answer thins each series server-side to `max_points` (2000 unless the caller asks for a `limit`), keeping its
first and last points, in the REST shape `{"series": {name: [{attempt, step, value, time}]}}`."""

from datetime import UTC, datetime

from server.models import MetricPoint
from tests.inprocess import App

POINTS = 30_000


def _fill(api: App, run_id: str, name: str, attempt: int, steps: range) -> None:
    now = datetime.now(UTC)
    rows = [{"run_id": run_id, "attempt": attempt, "line": i, "name": name, "step": step, "value": step / 10,
             "time": now} for i, step in enumerate(steps)]
    with api.session() as s:
        s.execute(MetricPoint.__table__.insert(), rows)


def test_a_long_series_is_thinned_to_a_bounded_answer_that_keeps_its_ends(api: App) -> None:
    run = api.submit()
    _fill(api, run["id"], "loss", 1, range(POINTS))
    _fill(api, run["id"], "loss", 2, range(POINTS // 2, POINTS // 2 + 5000))
    _fill(api, run["id"], "lr", 1, range(0, 500, 10))

    r = api.client.get(f"/v1/runs/{run['id']}/metrics")
    assert r.status_code == 200
    assert len(r.content) < 400_000  # 35,050 points stored
    series = r.json()["series"]
    assert set(series) == {"loss", "lr"}
    assert set(series["loss"][0]) == {"attempt", "step", "value", "time"}
    for number, first, last in ((1, 0, POINTS - 1), (2, POINTS // 2, POINTS // 2 + 4999)):
        points = [p for p in series["loss"] if p["attempt"] == number]
        steps = [p["step"] for p in points]
        assert len(points) <= 2000
        assert (steps[0], steps[-1]) == (first, last)
        assert steps == sorted(steps)
        # evenly spread: no gap wider than two strides
        assert max(b - a for a, b in zip(steps, steps[1:], strict=False)) <= 2 * (last - first) / 1999 + 1
        assert points[-1]["value"] == last / 10
    # a short series comes whole
    assert [p["step"] for p in series["lr"]] == list(range(0, 500, 10))

    few = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"names": "loss", "attempt": 1, "max_points": 100})
    steps = [p["step"] for p in few.json()["series"]["loss"]]
    assert len(steps) <= 100 and (steps[0], steps[-1]) == (0, POINTS - 1)
    # since_step thins what is after it
    after = api.client.get(f"/v1/runs/{run['id']}/metrics",
                           params={"names": "loss", "attempt": 1, "since_step": POINTS - 100, "max_points": 10})
    steps = [p["step"] for p in after.json()["series"]["loss"]]
    assert len(steps) <= 10 and (steps[0], steps[-1]) == (POINTS - 99, POINTS - 1)


def test_a_caller_that_asks_for_a_limit_gets_every_point_up_to_it(api: App) -> None:
    run = api.submit()
    _fill(api, run["id"], "loss", 1, range(5000))
    r = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 100_000})
    assert [p["step"] for p in r.json()["series"]["loss"]] == list(range(5000))
    r = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 10})
    assert [p["step"] for p in r.json()["series"]["loss"]] == list(range(10))
