"""Every integer a client sends to the runs routes is held to a range the database compares without overflowing: a
value past it is a 422 naming the parameter (before: `metrics?since_step=-99999999999999999999` was a 500, SQLite's
driver raising OverflowError on a number past 64 bits)."""

from typing import Any

import pytest

from tests.inprocess import App

pytestmark = pytest.mark.sqlite_only

HUGE = 10**20


def _integer_parameters(api: App) -> list[tuple[str, str, str, str]]:
    """(method, path, where, name) of every integer query parameter and header of /v1/runs/..., from the schema."""
    found = []
    for path, operations in api.app.openapi()["paths"].items():
        if not path.startswith("/v1/runs"):
            continue
        for method, op in operations.items():
            for param in op.get("parameters", []):
                schema: dict[str, Any] = param["schema"]
                kinds = [schema.get("type")] + [s.get("type") for s in schema.get("anyOf", [])]
                if "integer" in kinds and param["in"] in ("query", "header"):
                    found.append((method.upper(), path, param["in"], param["name"]))
    return found


def test_an_integer_past_64_bits_in_any_runs_parameter_is_a_422_naming_it(api: App) -> None:
    run = api.submit()
    params = _integer_parameters(api)
    assert {name for *_, name in params} >= {"since_step", "limit", "attempt", "tail", "since_offset", "node", "rank",
                                             "max_points", "last-event-id"}
    answers = []
    for method, path, where, name in params:
        url = path.replace("{run_id}", run["id"])
        for value in (HUGE, -HUGE):
            sent = {"headers": {name: str(value)}} if where == "header" else {"params": {name: value}}
            if path.endswith("/traceback") and name != "rank":
                sent.setdefault("params", {})["rank"] = 0
            if method == "POST":
                sent["json"] = {}
            r = api.client.request(method, url, **sent)
            answers.append((method, url, name, value, r.status_code))
            assert r.status_code == 422, (method, url, name, value, r.status_code, r.text[:300])
            assert [where, name] in [e["loc"] for e in r.json()["detail"]], r.text[:300]
    assert len(answers) >= 2 * 9


@pytest.mark.parametrize("value", ["-99999999999999999999", "99999999999999999999"])
def test_since_step_out_of_range_is_a_422_not_a_500(api: App, value: str) -> None:
    run = api.submit()
    r = api.client.get(f"/v1/runs/{run['id']}/metrics", params={"since_step": value})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["query", "since_step"]
