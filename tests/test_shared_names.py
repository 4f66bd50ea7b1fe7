"""The names the server defines and others must spell alike: run and attempt statuses (server/lifecycle.py) and the
GPU series (server/series.py). The OpenAPI schema lists the statuses; the client, the CLI's views, the page and the
trainer's tracker tags keep their own copies (none of them may import the server), pinned here to the server's.
The bundled trainer's series are named in trainer/series.py, which the server, the worker and the views import; the
page's copy (names.js TRAINER_SERIES) is pinned here, and its charts must read them from it."""

import json
import re
from pathlib import Path

import pytest

from longrun import client, views
from server.lifecycle import TERMINAL, AttemptStatus, RunStatus
from server.series import GPU_SERIES, SERVER_SERIES, GpuSeries, gpu_series
from tests.inprocess import App
from trainer import series, trackers

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
    for described in (schemas["RunPublic"]["properties"]["latest"], schemas["MetricsPage"]["properties"]["series"]):
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


def test_the_page_has_the_trainers_series_names_as_trainer_series_prints_them() -> None:
    names = (WEB / "names.js").read_text()
    assert json.loads(js_constant(names, "TRAINER_SERIES")) == series.NAMES
    assert series.page_constant() in names.splitlines()


# where page code spells a series name itself: a comparison or prefix test with a string, a string's length, a
# regular expression literal, a property read off `latest`
LITERAL_USES = (r'===\s*"([^"]*)"', r'"([^"]*)"\s*===', r'startsWith\("([^"]*)"\)', r'"([^"]*)"\.length',
                r'(?<![\w)\]])/\^?([a-z_]+)_?\\d\+\$?/', r'latest\??\.([a-z][a-z0-9_]*)', r'\bname: "([^"]*)"')
TRAINER_NAME = re.compile(rf"^(?:{series.VAL})?(?:{'|'.join(map(re.escape, series.NAMES.values()))})(?:_\d*)?$")


def literal_series(source: str) -> list[str]:
    code = "\n".join(line.split("//", 1)[0] for line in source.splitlines())
    return [found for pattern in LITERAL_USES for found in re.findall(pattern, code) if TRAINER_NAME.match(found)]


def test_the_pattern_finds_a_series_the_page_spells_itself() -> None:
    before = ('match: (n) => n === "loss_0" || n === "val_loss", fallback: { match: (n) => /^acc_\\d+$/.test(n) }\n'
              'if (name.startsWith("val_")) x = name.slice("sim_acc_".length) + run.latest?.sim_tau_16;\n'
              '({ name: "sim_acc", attempt }); // "loss" === n in a comment\n'
              'el("span", { id: "loss" }, "Loss of TTT step 0 (loss_0)"); n === "tokens"; /^gpu_util_\\d+$/')
    assert literal_series(before) == ["loss_0", "val_loss", "val_", "sim_acc_", "acc_", "sim_tau_16", "sim_acc"]


def test_the_run_pages_charts_read_the_trainers_series_from_names_js() -> None:
    page = (WEB / "run-page.js").read_text()
    assert re.search(r"import \{[^}]*\bTRAINER_SERIES\b[^}]*\} from \"\./names\.js\"", page)
    assert literal_series(page) == []


def test_the_markers_of_a_non_finite_value_are_the_ingests() -> None:
    from worker.metric_values import NOT_FINITE_MARKERS

    assert views.NOT_FINITE == NOT_FINITE_MARKERS
    assert js_strings(js_constant((WEB / "names.js").read_text(), "NOT_FINITE")) == NOT_FINITE_MARKERS
