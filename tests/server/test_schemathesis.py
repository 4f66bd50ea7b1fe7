"""Schemathesis over the OpenAPI document, in-process against the ASGI app: no generated request is a 5xx, and
none echoes a secret. Bounded to fit CI: EXAMPLES per operation (about 15 operations), each a Hypothesis run.
Then Hypothesis alone over what the document's bounds leave out: integers far out of range and lone surrogates in
every route's parameters and body fields."""

# Schemathesis and Hypothesis are imported by the tests, not at collection (about 0.4 s of CPU in each pytest process
# that collects this module, most of which never run it). The functions Hypothesis runs keep their source and
# signature, from which derandomize seeds them: the names they use now come from the enclosing test

import json
from typing import TYPE_CHECKING
from urllib.parse import quote

import pytest

from tests.inprocess import App

if TYPE_CHECKING:
    import schemathesis

EXAMPLES = 15
SECRET = "s3cret-value"


@pytest.mark.slow  # generates hundreds of requests
def test_no_generated_request_is_a_server_error(api: App) -> None:
    import schemathesis

    api.submit(env={"HF_TOKEN": SECRET})  # a run to list, so listings build real answers
    schema = schemathesis.openapi.from_dict(api.client.get("/openapi.json").json())
    schema.app = api.app  # called in-process, over ASGI
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14
    statuses: list[int] = []
    for operation in operations:
        _fuzz(operation, statuses)
    assert len(statuses) > 5 * len(operations), "the generated requests were sent"
    assert {200, 404, 422} <= set(statuses), "valid requests as well as refused ones"


def _fuzz(operation: "schemathesis.APIOperation", statuses: list[int]) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def no_server_error(case: schemathesis.Case) -> None:
        if case.path.endswith("/gpus") and case.query:
            case.query["wait"] = 0  # the route may wait up to a minute for a worker that is not here
        response = case.call(base_url="http://127.0.0.1")
        statuses.append(response.status_code)
        assert response.status_code < 500, (f"{case.method} {case.formatted_path} query={case.query} "
                                            f"body={case.body!r:.300} -> {response.status_code} {response.text[:500]}")
        assert SECRET not in response.text, f"{case.method} {case.formatted_path} echoed an env value"

    no_server_error()


def _hostile():
    """(HUGE, HOSTILE_TEXT, HOSTILE): the strategies of the out-of-range test."""
    from hypothesis import strategies as st

    # out of range for every integer column and type on the way: int32, int64, a float's exact integers, far beyond
    HUGE = st.sampled_from([2**31 - 1, 2**31, -2**31 - 1, 2**53 + 1, 2**63 - 1, 2**63, -2**63 - 1, 10**30, -10**30])
    # text a request can carry and a terminal or an encoder chokes on: lone surrogates, control characters
    SURROGATES = st.text(st.characters(categories=("Cs",)), min_size=1, max_size=3)
    HOSTILE_TEXT = st.one_of(SURROGATES, st.text(st.characters(categories=("Cs", "Cc", "Zl", "Lo")), min_size=1,
                                                 max_size=6).map(lambda s: s + "\ud800"))
    HOSTILE = st.one_of(HUGE, HOSTILE_TEXT, HOSTILE_TEXT.map(lambda s: [s]), HOSTILE_TEXT.map(lambda s: {s: s}),
                        HOSTILE_TEXT.map(lambda s: {"a": s}))
    return HUGE, HOSTILE_TEXT, HOSTILE
VALID_BODIES = {"RunCreate": {"name": "fuzz", "host": "local", "entrypoint": "/opt/train.py"},
                "HostCreate": {"name": "fuzzbox", "address": "10.0.0.9", "workspace": "/srv/ws"},
                "HostUpdate": {"python": "python3"}, "RestartRequest": {"overrides": {}},
                "InterconnectProbeCreate": {"tp": 2}, "VerifierProbeCreate": {"config": "/m/v", "tp": 2}}


def _parameters(document: dict) -> list[tuple[str, str, dict, str | None]]:
    """(method, path, {name: (in, type)}, body schema name) of every operation; a parameter's type is the first
    of `integer`, `number`, `string`, `boolean`, `array` it may take."""
    found = []
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            params = {}
            for p in op.get("parameters", []):
                schema = p["schema"]
                types = [s.get("type") for s in schema.get("anyOf", [schema])]
                kind = next((t for t in ("integer", "number", "string", "boolean", "array") if t in types), "string")
                params[p["name"]] = (p["in"], kind)
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            ref = next((s["$ref"] for s in [body, *body.get("anyOf", [])] if "$ref" in s), None)
            found.append((method.upper(), path, params, ref.rsplit("/", 1)[1] if ref else None))
    return found


def test_out_of_range_integers_and_lone_surrogates_in_any_parameter_are_never_a_server_error(api: App) -> None:
    """Every route's integer parameters (query, path, header) far out of range, its strings holding lone
    surrogates (in a URL: their UTF-8 bytes, percent-encoded), and each field of each JSON body set to either, one
    at a time on a request that is otherwise valid: a 4xx every time, with a JSON answer that decodes."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    HUGE, HOSTILE_TEXT, HOSTILE = _hostile()
    run = api.submit()
    document = api.client.get("/openapi.json").json()
    operations = _parameters(document)
    properties = {name: list(document["components"]["schemas"][name]["properties"]) for name in VALID_BODIES}
    statuses: list[int] = []

    @given(data=st.data())
    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def no_server_error(data: st.DataObject) -> None:
        method, path, params, body_schema = data.draw(st.sampled_from(operations))
        target = data.draw(st.sampled_from([*params, *(["body"] if body_schema else [])] or ["none"]))
        values = {name: ("local" if name == "name" else run["id"]) for name, (where, _) in params.items()
                  if where == "path"}
        query, headers = {}, {"content-type": "application/json"}
        if target in params:
            where, kind = params[target]
            hostile = data.draw(HUGE if kind in ("integer", "number") else HOSTILE_TEXT)
            if where == "path":
                values[target] = hostile
            elif where == "query":
                query[target] = hostile
            elif isinstance(hostile, int):  # a header carries no surrogate: HTTP headers are bytes, read as latin-1
                headers[target] = str(hostile)
        if path.endswith("/events") and target != "run_id":
            values["run_id"] = "0000dead"  # a real run's stream would not end: a run that is not there
        url = path.format(**{k: quote(str(v), safe="", errors="surrogatepass") for k, v in values.items()})
        if query:
            url += "?" + "&".join(f"{k}={quote(str(v), safe='', errors='surrogatepass')}" for k, v in query.items())
        body = None
        if body_schema:
            body = dict(VALID_BODIES[body_schema])
            if target == "body":
                body[data.draw(st.sampled_from(properties[body_schema]))] = data.draw(HOSTILE)
        content = json.dumps(body) if body is not None else None  # a lone surrogate goes as its JSON escape
        response = api.client.request(method, url, content=content, headers=headers)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{method} {url} {content!r:.300} -> {response.status_code} {response.text[:300]}"
        if response.headers.get("content-type", "").startswith("application/json"):
            response.json()

    no_server_error()
    assert {200, 422} <= set(statuses) and len(statuses) >= 300, sorted(set(statuses))
