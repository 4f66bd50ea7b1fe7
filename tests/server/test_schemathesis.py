"""Schemathesis over the OpenAPI document, in-process against the ASGI app: no generated request is a 5xx, and
none echoes a secret. Bounded to fit CI: EXAMPLES per operation (about 15 operations), each a Hypothesis run."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.inprocess import App

EXAMPLES = 15
SECRET = "s3cret-value"


@pytest.mark.slow  # generates hundreds of requests
def test_no_generated_request_is_a_server_error(api: App) -> None:
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


def _fuzz(operation: schemathesis.APIOperation, statuses: list[int]) -> None:
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
