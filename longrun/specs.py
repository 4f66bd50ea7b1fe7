"""Run specs as files: YAML or JSON (docs/api.md's fields either way), or `-` for standard input."""

import json
import sys
from pathlib import Path
from typing import Any

import yaml


class SpecError(ValueError):
    """The file is missing or is neither a JSON nor a YAML mapping."""


def read_spec(path: str) -> dict[str, Any]:
    """The spec in `path`: JSON for a .json file, YAML otherwise (JSON is YAML too)."""
    if path == "-":
        text, name = sys.stdin.read(), "standard input"
    else:
        try:
            text, name = Path(path).read_text(), path
        except OSError as exc:
            raise SpecError(f"cannot read {path}: {exc.strerror}") from None
    try:
        spec = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{name} is not JSON: {exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{name} is not YAML: {exc}") from None
    if not isinstance(spec, dict):
        raise SpecError(f"{name} holds a {type(spec).__name__}, not a run spec (a mapping of fields)")
    return spec


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs; each VALUE is read as JSON when it parses (5, true, ["a"]), else kept as text."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
