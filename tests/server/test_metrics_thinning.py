"""A run of many stored points reads in a moment (docs/reliability.md, "a run of a million points"): the metrics
answer thins each series server-side to `max_points` (2000 unless the caller asks for a `limit`), keeping its
first and last points, in the REST shape `{"series": {name: [{attempt, step, value, time}]}}`."""

from datetime import UTC, datetime

from server import queries
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
    r = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 20_000})
    assert [p["step"] for p in r.json()["series"]["loss"]] == list(range(5000))
    r = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 10})
    assert [p["step"] for p in r.json()["series"]["loss"]] == list(range(10))


def _pages(api: App, run_id: str, **params: object) -> list[dict]:
    """Every answer of a read that follows next_cursor to its end."""
    answers = [api.client.get(f"/v1/runs/{run_id}/metrics", params=params)]
    while answers[-1].status_code == 200 and answers[-1].json()["next_cursor"]:
        cursor = answers[-1].json()["next_cursor"]
        answers.append(api.client.get(f"/v1/runs/{run_id}/metrics", params={**params, "cursor": cursor}))
        assert len(answers) < 1000
    assert all(a.status_code == 200 for a in answers), answers[-1].text
    return [a.json() for a in answers]


def test_every_point_reads_page_by_page_none_lost_or_doubled_each_page_bounded(api: App) -> None:
    run = api.submit()
    _fill(api, run["id"], "loss", 1, range(1, 25_001))
    _fill(api, run["id"], "loss", 2, range(100, 3100))
    now = datetime.now(UTC)
    with api.session() as s:  # GPU samples: no line, and before the first step none either
        s.execute(MetricPoint.__table__.insert(), [
            {"run_id": run["id"], "attempt": 1, "line": None, "name": "gpu_util_0", "step": step, "value": 50.0,
             "time": now} for step in [None] * 30 + list(range(1, 31))])
    asked = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 1_000_000})
    assert asked.status_code == 422 and asked.json()["detail"][0]["loc"] == ["query", "limit"]

    pages = _pages(api, run["id"], limit=7000)
    assert len(pages) == 5 and pages[-1]["next_cursor"] is None
    assert all(sum(len(p) for p in page["series"].values()) <= 7000 for page in pages)
    got: dict[str, list[tuple[int, int | None]]] = {}
    for page in pages:
        for name, points in page["series"].items():
            got.setdefault(name, []).extend((p["attempt"], p["step"]) for p in points)
    assert got["loss"] == [(1, s) for s in range(1, 25_001)] + [(2, s) for s in range(100, 3100)]
    assert got["gpu_util_0"] == [(1, None)] * 30 + [(1, s) for s in range(1, 31)]

    # a follower reading on where it stopped while the job writes: each new point once
    first = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"names": "lr", "limit": 10}).json()
    assert first == {"series": {}, "next_cursor": None}
    _fill(api, run["id"], "lr", 3, range(0, 15))
    pages = _pages(api, run["id"], names="lr", limit=10)
    assert [p["step"] for page in pages for p in page["series"].get("lr", [])] == list(range(15))


def test_a_thinned_read_of_many_series_comes_in_pages_of_whole_series(api: App) -> None:
    run = api.submit()
    names = [f"acc_{i:02d}" for i in range(14)]
    for name in names:
        _fill(api, run["id"], name, 1, range(5000))
    pages = _pages(api, run["id"])  # the page's read: thinned to 2000 a series
    assert len(pages) > 1
    seen = []
    for page in pages:
        assert sum(len(p) for p in page["series"].values()) <= queries.MAX_POINTS_PER_ANSWER
        for name, points in page["series"].items():
            seen.append(name)
            steps = [p["step"] for p in points]
            assert len(steps) <= 2000 and (steps[0], steps[-1]) == (0, 4999), name
    assert seen == names, "each series whole, in one answer, once"


def test_a_cursor_not_given_by_this_read_is_a_422_naming_it(api: App) -> None:
    run = api.submit()
    _fill(api, run["id"], "loss", 1, range(50))
    thinned = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"max_points": 10, "limit": 10}).json()
    full = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 10}).json()
    for cursor, params in (("nonsense!", {"limit": 10}), (full["next_cursor"], {}),
                           (full["next_cursor"][:-3], {"limit": 10}), ("W10", {"limit": 10})):
        r = api.client.get(f"/v1/runs/{run['id']}/metrics", params={**params, "cursor": cursor})
        assert r.status_code == 422, (cursor, r.text)
        assert r.json()["detail"][0]["loc"] == ["query", "cursor"]
    assert thinned["next_cursor"] is None  # one series thinned to 10: one answer
    one = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"max_points": 10, "limit": 1})
    assert one.status_code == 422 and one.json()["detail"][0]["loc"] == ["query", "limit"], one.text
