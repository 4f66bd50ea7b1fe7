"""A restart's overrides are a typed model (server/schemas.py `RestartOverrides`): the fields a restart may change,
each with the type and bounds of the spec field it replaces, checked when the request is read; the merge into the
run's spec (server/runs.py `apply_overrides`) then checks the rules between fields."""

import pytest
from pydantic import ValidationError

from server.errors import FieldError
from server.runs import apply_overrides
from server.schemas import RestartOverrides, RestartRequest
from server.spec import RESTART_TOP_LEVEL, TRAINER_FIELDS, RunCreate

TRAINER_RUN = RunCreate.model_validate({"host": "box", "trainer": {
    "verifier_path": "/m/v", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": "/o", "epochs": 2}})
ENTRYPOINT_RUN = RunCreate.model_validate({"host": "box", "entrypoint": "/opt/train.py", "args": ["--steps", "9"],
                                           "env": {"TOKEN": "s3cret"}})


def refusal(overrides: dict) -> list[tuple[tuple, str]]:
    with pytest.raises(ValidationError) as caught:
        RestartRequest.model_validate({"overrides": overrides})
    return [(e["loc"], e["msg"]) for e in caught.value.errors()]


def test_the_overrides_are_the_spec_fields_a_restart_may_change_and_the_trainers() -> None:
    assert set(RestartOverrides.model_fields) == RESTART_TOP_LEVEL | TRAINER_FIELDS
    schema = RestartRequest.model_json_schema()
    assert schema["properties"]["overrides"]["$ref"].endswith("/RestartOverrides")
    given = RestartRequest.model_validate({"overrides": {"ttt_steps": 5, "init_from": None}}).overrides
    assert given.trainer() == {"ttt_steps": 5, "init_from": None} and given.top_level() == {}
    assert given.given() == {"ttt_steps": 5, "init_from": None}  # a null clears the field: it is kept
    assert RestartRequest().overrides.given() == {}


def test_an_unknown_override_is_named_with_what_may_be_overridden() -> None:
    [(loc, msg)] = refusal({"colour": "red"})
    assert loc == ("overrides", "colour") and msg.startswith("unknown override 'colour'; allowed: args, auto_restart_max_factor, cwd, ")
    assert "trainer's fields: batch_size, " in msg and "ttt_steps" in msg
    both = refusal({"colour": "red", "ttt_steps": 0})
    assert {loc for loc, _ in both} == {("overrides", "colour"), ("overrides", "ttt_steps")}


@pytest.mark.parametrize(("overrides", "loc", "says"), [
    ({"ttt_steps": 0}, ("overrides", "ttt_steps"), "greater than 0"),
    ({"ttt_steps": 65}, ("overrides", "ttt_steps"), "less than or equal to 64"),
    ({"nproc_per_node": 0}, ("overrides", "nproc_per_node"), "greater than 0"),
    ({"output_dir": "relative"}, ("overrides", "output_dir"), "absolute path"),
    ({"scheduler": "cyclic"}, ("overrides", "scheduler"), "'cosine', 'linear' or 'constant'"),
    ({"env": {"LONGRUN_X": "1"}}, ("overrides", "env"), "set by longrun itself"),
    ({"slurm": {"nodes": 0}}, ("overrides", "slurm", "nodes"), "greater than or equal to 1"),
])
def test_a_bad_value_is_refused_at_its_field_as_the_spec_would(overrides: dict, loc: tuple, says: str) -> None:
    [(where, msg)] = refusal(overrides)
    assert where == loc and says in msg


def test_the_merge_applies_what_was_given_and_keeps_the_rest() -> None:
    merged = apply_overrides(TRAINER_RUN, RestartOverrides(ttt_steps=5, max_retries=2))
    assert (merged.trainer.ttt_steps, merged.trainer.epochs, merged.max_retries) == (5, 2, 2)
    assert TRAINER_RUN.trainer.ttt_steps == 3  # the run's own spec is left as it was
    cleared = apply_overrides(ENTRYPOINT_RUN, RestartOverrides.model_validate({"args": [], "cwd": None}))
    assert cleared.args == [] and cleared.env == {"TOKEN": "s3cret"} and cleared.entrypoint == "/opt/train.py"


def test_the_merge_refuses_a_trainer_field_without_a_trainer_and_a_rule_between_fields() -> None:
    with pytest.raises(FieldError) as no_trainer:
        apply_overrides(ENTRYPOINT_RUN, RestartOverrides(ttt_steps=5))
    assert no_trainer.value.errors[0]["loc"] == ("overrides", "ttt_steps")
    assert "a trainer field, but this run has no `trainer`" in str(no_trainer.value)
    with pytest.raises(FieldError) as both:
        apply_overrides(TRAINER_RUN, RestartOverrides(entrypoint="/opt/train.py"))
    assert "exactly one of `trainer` or `entrypoint`" in str(both.value)
    with pytest.raises(FieldError) as cleared:
        apply_overrides(TRAINER_RUN, RestartOverrides.model_validate({"verifier_path": None}))
    assert cleared.value.errors[0]["loc"] == ("overrides", "verifier_path")
