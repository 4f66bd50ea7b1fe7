"""The names the server defines and others must spell alike: run and attempt statuses (server/lifecycle.py) and the
GPU series (server/series.py). The OpenAPI schema lists the statuses; the client, the CLI's views, the page and the
trainer's tracker tags keep their own copies (none of them may import the server), pinned here to the server's."""

import re
from pathlib import Path

import pytest

from longrun import client, views
from server.lifecycle import TERMINAL, AttemptStatus, RunStatus
from server.series import GPU_SERIES, SERVER_SERIES, GpuSeries, gpu_series
from tests.inprocess import App
from trainer import trackers

WEB = Path(__file__).resolve().parent.parent / "server" / "web"
GPU_NAMES = [gpu_series(kind, gpu, node) for kind in GpuSeries for gpu in (0, 7, 12) for node in (0, 1, 10)]
NOT_GPU_NAMES = ["loss", "acc_0", "gpu_util", "gpu_util_", "gpu_temp_0", "xgpu_util_0", "gpu_util_0x", "node_gpu_mem_0",
                 "node1gpu_util_0", "node1_", "attempt"]


def js_constant(source: str, name: str) -> str:
    return re.search(rf"export const {name} = (.+);$", source, re.M).group(1)


def js_strings(literal: str) -> set[str]:
    return set(re.findall(r'"([^"]*)"', literal))


def js_regex(literal: str) -> re.Pattern:
    return re.compile(re.fullmatch(r"/(.+)/", literal).group(1))


@pytest.mark.sqlite_only  # the schema does not depend on the store
def test_the_openapi_schema_lists_the_statuses_and_names_the_servers_series(api: App) -> None:
    schemas = api.client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["RunPublic"]["properties"]["status"]["$ref"].endswith("/RunStatus")
    assert schemas["AttemptPublic"]["properties"]["status"]["$ref"].endswith("/AttemptStatus")
    assert schemas["RunStatus"]["enum"] == [s.value for s in RunStatus]
    assert schemas["AttemptStatus"]["enum"] == [s.value for s in AttemptStatus]
    for described in (schemas["RunPublic"]["properties"]["latest"], schemas["MetricsPublic"]["properties"]["series"]):
        assert all(f"`{kind}_<i>`" in described["description"] for kind in GpuSeries)


def test_the_clients_statuses_and_the_cli_styles_are_the_servers() -> None:
    assert set(client.RUN_STATUSES) == set(RunStatus) and len(client.RUN_STATUSES) == len(RunStatus)
    assert set(client.ATTEMPT_STATUSES) == set(AttemptStatus) and len(client.ATTEMPT_STATUSES) == len(AttemptStatus)
    assert client.TERMINAL == TERMINAL
    assert set(views.STATE_STYLES) == set(RunStatus) | set(AttemptStatus)


def test_the_pages_statuses_and_their_badges_are_the_servers() -> None:
    names = (WEB / "names.js").read_text()
    states = js_constant(names, "RUN_STATES")
    assert js_strings(states) == set(RunStatus) and states.count('"') == 2 * len(RunStatus)
    assert js_strings(js_constant(names, "TERMINAL")) == TERMINAL
    styled = set(re.findall(r"\.status-([a-z]+)", (WEB / "style.css").read_text()))
    assert set(RunStatus) | set(AttemptStatus) <= styled


def test_every_copy_of_the_gpu_series_names_what_the_worker_stores() -> None:
    names = (WEB / "names.js").read_text()
    page = {GpuSeries.UTIL: js_regex(js_constant(names, "GPU_UTIL_SERIES")),
            GpuSeries.MEM: js_regex(js_constant(names, "GPU_MEM_SERIES"))}
    for name in GPU_NAMES:
        server = GPU_SERIES.match(name)
        assert server and SERVER_SERIES.match(name), name
        cli = views.GPU_KEY.match(name)
        assert cli and (cli["node"], cli["kind"], cli["gpu"]) == (server["node"], server["kind"][4:], server["gpu"])
        assert trackers.GPU_METRIC.match(name) and trackers.tag_for(name) == f"system/{name}"
        assert {kind for kind, pattern in page.items() if pattern.match(name)} == {server["kind"]}
    for name in NOT_GPU_NAMES:
        assert not any(p.match(name) for p in (GPU_SERIES, views.GPU_KEY, trackers.GPU_METRIC, *page.values())), name
    assert SERVER_SERIES.match("attempt") and not SERVER_SERIES.match("loss")
