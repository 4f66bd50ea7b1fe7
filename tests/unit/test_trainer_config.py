"""The trainer's typed config (trainer/config.py) and the run spec's `TrainerSpec` (server/spec.py), pinned to each
other field for field: the same names, types and defaults, and every value a spec can hold reaching the trainer as
that value through the flags the worker writes (worker/jobs.py `trainer_flags`) and the parser reads."""

import argparse
import json
import types
from dataclasses import MISSING, fields
from typing import Annotated, Literal, Union, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel, Field, create_model

from server.spec import TrainerSpec
from trainer.config import FLAG_SECTIONS, SECTIONS, TrainConfig, flag_field
from worker.jobs import trainer_flags

# trainer settings a run spec deliberately cannot set, each with the reason (none today: every flag is exposed)
NOT_EXPOSED: dict[str, str] = {}
# settings a spec carries as one comma-separated string: the trainer's value it becomes
ENCODED = {"layer_ids": ("2,16,29", [2, 16, 29]), "export_format": ("engine,speculators", ("engine", "speculators")),
           "report_to": ("tensorboard", "tensorboard")}
# flags the trainer refuses together (argparse's mutually exclusive group; --init-from with an lm_head of its own)
EXCLUSIVE = (("global_batch_size", "global_batch_tokens"), ("init_from", "init_lm_head_from_verifier"))
REQUIRED = ["--verifier-path", "/v", "--data-dir", "/d", "--vocab-mapping-dir", "/m", "--output-dir", "/o"]


# trainer.train's parser, imported at first use: trainer.train imports torch, which a pytest process collecting this
# module and never running it (the PostgreSQL lane's) would pay for nothing
def build_parser() -> argparse.ArgumentParser:
    from trainer.train import build_parser

    return build_parser()


def parse_args(argv: list[str]) -> TrainConfig:
    from trainer.train import parse_args

    return parse_args(argv)


def trainer_type(name: str) -> object:
    owner = SECTIONS.get(FLAG_SECTIONS[name], TrainConfig)
    return get_type_hints(owner)[name]


def without_none(annotation: object) -> object:
    """`X | None` -> X, `Annotated[X, ...]` -> X."""
    if get_origin(annotation) is Annotated:
        return without_none(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return without_none(rest[0]) if len(rest) == 1 else annotation
    return annotation


def choices() -> dict[str, set[str]]:
    return {a.dest: set(a.choices) for a in build_parser()._actions if a.choices}


def drift(spec: type[BaseModel]) -> list[str]:
    """How `spec` and TrainConfig disagree: a field only one of them has, a type, a default, whether it is required."""
    found = [f"{name}: in TrainerSpec only" for name in spec.model_fields if name not in FLAG_SECTIONS]
    found += [f"{name}: in TrainConfig only (expose it, or list it in NOT_EXPOSED with the reason)"
              for name in FLAG_SECTIONS if name not in spec.model_fields and name not in NOT_EXPOSED]
    for name, info in spec.model_fields.items():
        if name not in FLAG_SECTIONS:
            continue
        ours, theirs, default = without_none(trainer_type(name)), without_none(info.annotation), flag_field(name).default
        if get_origin(theirs) is Literal:
            if set(get_args(theirs)) != choices().get(name):
                found.append(f"{name}: TrainerSpec allows {sorted(get_args(theirs))}, the trainer {choices().get(name)}")
        elif name in ENCODED:
            if theirs is not str:
                found.append(f"{name}: TrainerSpec carries {theirs}, not the comma-separated str the flag reads")
        elif theirs is not ours:
            found.append(f"{name}: TrainerSpec {theirs}, TrainConfig {ours}")
        if (default is MISSING) != info.is_required():
            found.append(f"{name}: required in {'TrainConfig' if default is MISSING else 'TrainerSpec'} only")
        elif not info.is_required() and info.default is not None and info.default != default:
            found.append(f"{name}: default {info.default!r} in TrainerSpec, {default!r} in the trainer")
        if ours is bool and default is not False:
            found.append(f"{name}: a switch the spec turns on only (trainer_flags leaves False out) must default False")
    return found


def test_trainer_spec_and_train_config_have_the_same_fields_types_and_defaults() -> None:
    assert drift(TrainerSpec) == []
    assert set(NOT_EXPOSED) <= set(FLAG_SECTIONS) and all(NOT_EXPOSED.values())


def test_the_pin_names_a_field_that_drifts() -> None:
    fields_of = {name: (info.annotation, info) for name, info in TrainerSpec.model_fields.items()}
    drifted = create_model("Drifted", **{**fields_of, "lr": (int | None, Field(None)), "ttt_steps": (int, Field(4)),
                                         "colour": (str | None, Field(None))}, __base__=BaseModel)
    found = drift(drifted)
    assert any(f.startswith("lr: TrainerSpec <class 'int'>") for f in found)
    assert "ttt_steps: default 4 in TrainerSpec, 3 in the trainer" in found and "colour: in TrainerSpec only" in found
    fewer = create_model("Fewer", **{k: v for k, v in fields_of.items() if k != "sim_depth"}, __base__=BaseModel)
    assert [f for f in drift(fewer) if f.startswith("sim_depth: in TrainConfig only")]


def test_the_parser_takes_each_default_from_train_config_and_names_a_field_per_flag() -> None:
    actions = {a.dest: a for a in build_parser()._actions if a.dest != "help"}
    assert set(actions) == set(FLAG_SECTIONS)
    for dest, action in actions.items():
        default = flag_field(dest).default
        assert action.required == (default is MISSING), dest
        if default is not MISSING:
            assert action.default == default, dest


def sample_value(name: str, info) -> tuple[object, object]:
    """(a value the spec can hold that is not the trainer's default, what the trainer reads for it)."""
    if name in ENCODED:
        return ENCODED[name]
    kind, default = without_none(info.annotation), flag_field(name).default
    if get_origin(kind) is Literal:
        value = next(c for c in get_args(kind) if c != default)
        return value, value
    if kind is bool:
        return True, True
    if kind is int:
        return (8, 8) if default == 7 else (7, 7)
    if kind is float:
        return (0.375, 0.375) if default != 0.375 else (0.25, 0.25)
    return f"/x/{name}", f"/x/{name}"  # the spec's str fields are paths


@pytest.mark.parametrize("left_out", [0, 1])
def test_every_value_a_spec_holds_reaches_the_trainer_as_that_value(left_out: int) -> None:
    skipped = {pair[left_out] for pair in EXCLUSIVE}
    samples = {name: sample_value(name, info) for name, info in TrainerSpec.model_fields.items() if name not in skipped}
    spec = TrainerSpec(**{name: given for name, (given, _) in samples.items()})
    config = parse_args(trainer_flags(spec)).flags()
    assert {name: config[name] for name in samples} == {name: read for name, (_, read) in samples.items()}


def test_an_older_checkpoints_settings_read_as_a_config() -> None:
    """A checkpoint stores the settings flat, keyed by flag (`vars(args)` before TrainConfig): they read back."""
    config = parse_args([*REQUIRED, "--ttt-steps", "5", "--layer-ids", "2,3,4", "--export-format", "engine,speculators"])
    stored = json.loads(json.dumps(config.flags()))
    assert set(stored) == {a.dest for a in build_parser()._actions if a.dest != "help"}
    again = TrainConfig.from_flags({**stored, "export_format": tuple(stored["export_format"])})
    assert again == config and again.ttt.ttt_steps == 5 and again.data.layer_ids == [2, 3, 4]
    with pytest.raises(TypeError, match="unknown trainer settings: colour"):
        TrainConfig.from_flags({**stored, "colour": "red"})


def test_each_section_holds_its_own_settings() -> None:
    config = parse_args([*REQUIRED, "--ttt-steps", "5", "--lr", "0.001", "--sim-depth", "4", "--save-every", "9",
                         "--pack-samples", "--fc-norm", "--seed", "3"])
    assert (config.ttt.ttt_steps, config.optim.lr, config.validation.sim_depth, config.checkpoints.save_every,
            config.data.pack_samples, config.model.fc_norm, config.seed) == (5, 0.001, 4, 9, True, True, 3)
    assert config.data.data_dir == "/d" and config.model.verifier_path == "/v" and config.checkpoints.output_dir == "/o"
    assert sorted(SECTIONS) == sorted(f.name for f in fields(TrainConfig) if f.name != "seed")
