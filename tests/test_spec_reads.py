"""The run spec is read by attribute: only its schema module (server/spec.py) reads one by its keys, and the
typed spec read back from the database is the one that was stored.

Everywhere else, the server, the worker, the command line and the trainer, takes the typed spec (`RunCreate`,
`run.typed_spec`, `attempt.typed_spec`), so a renamed or retyped field fails where it is read, not at run time."""

import re
from pathlib import Path

import pytest

from longrun.specs import read_spec, resolve_paths
from server.spec import RunCreate, spec_dict, stored_spec

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("server", "worker", "longrun", "trainer")
SCHEMA_MODULE = ROOT / "server" / "spec.py"
# `spec["…"]`, `spec['…']` and `spec.get(`, also as the end of a longer name (new_spec, attempt_spec)
KEY_READ = re.compile(r"""spec\[["']|spec\.get\(""")


def key_reads(path: Path) -> list[str]:
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return [f"{name}:{number}: {line.strip()}"
            for number, line in enumerate(path.read_text().splitlines(), 1) if KEY_READ.search(line)]


def test_the_pattern_finds_what_it_pins(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text('a = spec["trainer"]\nb = new_spec.get("env")\nc = spec[\'host\']\nd = spec.trainer\n')
    assert [line.split(": ", 1)[1] for line in key_reads(sample)] == [
        'a = spec["trainer"]', 'b = new_spec.get("env")', "c = spec['host']"]


def test_no_module_outside_the_schema_reads_a_spec_by_its_keys() -> None:
    modules = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py")) if p != SCHEMA_MODULE]
    assert len(modules) > 100
    assert [read for path in modules for read in key_reads(path)] == []


SLURM_TRAINER = {"host": "login", "nproc_per_node": 4, "slurm": {"nodes": 2, "gpus_per_node": "h100:4",
                                                                "sbatch_options": ["--qos=high"]},
                 "trainer": {"verifier_path": "/m", "data_dir": "/d", "vocab_mapping_dir": "/v", "output_dir": "/o"},
                 "deploy": {"host": "box", "engine": "measured", "round_ms": {0: 20.0, 3: 31.5}}}
ENTRYPOINT = {"hosts": ["a", "b"], "entrypoint": "/opt/train.py", "args": ["--max-steps", "40"], "env": {"X": "1"},
              "log_metrics": {"patterns": [r"it (?P<step>\d+)"]}, "on_stall": "restart"}


def example(path: Path) -> dict:
    """An example spec as `longrun submit` sends it: its relative paths resolved."""
    body = read_spec(str(path))
    resolve_paths(body, str(path), lambda host: "/home/u/.longrun/workspace")
    return body


@pytest.mark.parametrize("body", [SLURM_TRAINER, ENTRYPOINT,
                                  *(example(p) for p in sorted((ROOT / "examples").glob("*.yaml")))])
def test_a_stored_spec_reads_back_as_the_spec_that_was_stored(body: dict) -> None:
    accepted = RunCreate.model_validate(body)
    stored = spec_dict(accepted)
    assert stored_spec(stored) == accepted and spec_dict(stored_spec(stored)) == stored


def test_a_spec_stored_before_a_rule_between_fields_still_reads() -> None:
    """What the API refuses now (a trainer run with log_metrics) may be stored from before: the worker reads it."""
    older = {**SLURM_TRAINER, "log_metrics": {"total_steps": 10}}
    with pytest.raises(ValueError, match="goes with `entrypoint`"):
        RunCreate.model_validate(older)
    spec = stored_spec(older)
    assert spec.trainer.output_dir == "/o" and spec.log_metrics.total_steps == 10 and spec.gpus == 8
