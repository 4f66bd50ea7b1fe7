"""Run specs as files: YAML or JSON (docs/api.md's fields either way), or `-` for standard input."""

import json
import os
import sys
from collections.abc import Callable
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


# trainer paths the job reads, and those it writes (on the host: under its workspace when relative)
INPUT_PATHS = ("verifier_path", "data_dir", "vocab_mapping_dir", "eval_corpus", "init_from")
HOST_PATHS = ("output_dir", "tracking_dir")
LOCAL_HOST = "local"


def resolve_paths(document: dict[str, Any], spec_file: str, workspace_of: Callable[[str], str]) -> list[str]:
    """Make the relative paths of a spec file's `document` (the mapping read, before the server types it) absolute,
    in place, and say what each became. A path the job writes
    (trainer.output_dir, trainer.tracking_dir, a command run's output_dir) is on the host: a relative one lies under
    the host's workspace, so a clean restart may empty it. A path the job reads (the trainer's inputs, an
    `entrypoint` script) lies beside the spec file when the host is `local` (this machine, where the file is), else
    under the host's workspace too. A path under the workspace whose `..` climbs out of it is refused (SpecError);
    `~` is not resolved here: the server refuses what is not absolute, naming the field."""
    hosts = document.get("hosts") or ([document["host"]] if isinstance(document.get("host"), str) else [])
    host = hosts[0] if hosts and isinstance(hosts[0], str) else None
    base = Path(spec_file).resolve().parent if spec_file != "-" else Path.cwd()
    workspace: list[str] = []

    def host_dir() -> str | None:
        if host is None:
            return None
        if not workspace:
            workspace.append(workspace_of(host))
        return workspace[0]

    said = []

    def resolve(section: dict[str, Any], key: str, where: str, beside_file: bool) -> None:
        value = section.get(key)
        if not isinstance(value, str) or not value or value.startswith(("/", "~")):
            return
        root = str(base) if beside_file else host_dir()
        if root is None:
            return
        resolved = os.path.normpath(Path(root) / value)
        if not beside_file and os.path.commonpath([resolved, root]) != root:
            raise SpecError(f"{where}{key}: {value} climbs out of the workspace {root} of host {host} with '..' "
                            f"(to {resolved}): longrun writes and cleans only inside it; give a path inside it, or "
                            f"an absolute one for a file elsewhere")
        section[key] = resolved
        said.append(f"{where}{key}: {value} -> {section[key]}")

    resolve(document, "entrypoint", "", beside_file=host == LOCAL_HOST)  # a script the job reads, as the trainer's
    trainer = document.get("trainer")
    if isinstance(trainer, dict):
        for key in INPUT_PATHS:
            resolve(trainer, key, "trainer.", beside_file=host == LOCAL_HOST)
        for key in HOST_PATHS:
            resolve(trainer, key, "trainer.", beside_file=False)
    resolve(document, "output_dir", "", beside_file=False)
    return said
