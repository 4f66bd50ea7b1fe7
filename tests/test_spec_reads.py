"""The run spec is read by attribute: only its schema module (server/spec.py) reads one by its keys.

Everywhere else, the server, the worker, the command line and the trainer, takes the typed spec (`RunCreate`,
`run.typed_spec`, `attempt.typed_spec`), so a renamed or retyped field fails where it is read, not at run time."""

import re
from pathlib import Path

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
