"""`longrun check-draft DIR [--engine vllm|sglang|speculators [--engine-version X]] [--verifier V]`: before serving,
replay how each engine release reads an exported EAGLE-3 draft (its config keys, every tensor by name and shape),
say which verifier layers it will capture and which of the draft's settings it ignores, and refuse an export it would
refuse to load, misread (RoPE, norm_before_residual, capture layers) or silently skip parts of.

The rules, and the loader code (engine release and file) each one mirrors, are longrun/draft_engines.py,
longrun/draft_misreads.py and longrun/draft_releases.py: vLLM read in its 0.21.0-0.34.0 releases, SGLang in
0.5.11-0.5.23, speculators 0.9.0; a release newer than the newest read is refused as unverified. docs/check-draft.md
holds the matrix of drafts and releases the rules are tested on.

Nothing here imports torch: reading is json and the safetensors header. The smoke decode (`--verifier`,
longrun/draft_smoke.py) loads torch and the trainer when it runs; its failure, or an acceptance under its floor, is a
refusal with the figures, not a traceback.
"""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from longrun.commands.common import JsonFlag, begin, emit
from longrun.draft_engines import read
from longrun.draft_releases import default_version, parse_version
from longrun.draft_rules import ENGINES, EngineReading, Verifier, read_verifier, safetensors_header
from longrun.draft_smoke import ACCEPTANCE_FLOOR, smoke_decode
from longrun.exit_codes import ExitCode

app = typer.Typer()
SMOKE_SOURCE = "longrun's decode of the draft with the verifier (longrun/draft_smoke.py)"


def engine_directories(directory: Path, engines: tuple[str, ...] | None) -> dict[str, Path]:
    """Which export each engine is checked on: DIR itself when named; by default the engines DIR's format is for,
    and speculators on DIR/speculators/ beside a longrun engine export."""
    if engines:
        return {engine: directory for engine in engines}
    if "speculators_model_type" in json.loads((directory / "config.json").read_text()):
        return {"vllm": directory, "speculators": directory}
    found = {"vllm": directory, "sglang": directory}
    if (directory / "speculators" / "config.json").is_file():
        found["speculators"] = directory / "speculators"
    return found


def parent_config(path: Path, config: dict) -> dict | None:
    """The engine export's config a speculators/ export sits in (longrun's record of its training)."""
    above = path.parent / "config.json"
    if "speculators_model_type" in config and above.is_file():
        return json.loads(above.read_text())
    return None


def training_config(path: Path, config: dict, parent: dict | None) -> dict | None:
    """The config the draft was trained with, where longrun's files keep it: its last checkpoint's config.json
    (checkpoints/step_N/, beside the engine export), else for a speculators/ export the engine export beside it."""
    run = path.parent if parent is not None else path
    steps = sorted((run / "checkpoints").glob("step_*/config.json")) if (run / "checkpoints").is_dir() else []
    if steps:
        return json.loads(steps[-1].read_text())
    return parent if parent and "ttt_steps" in parent else None


def check(directory: Path, engines: tuple[str, ...] | None = None, verifier: Path | Verifier | None = None,
          version: str | None = None) -> list[tuple[EngineReading, Path]]:
    """Each engine's reading of the export, with the directory it read (`version`: that of the one engine named)."""
    verifier = verifier if isinstance(verifier, Verifier) or verifier is None else read_verifier(verifier)
    readings = []
    for engine, path in engine_directories(directory, engines).items():
        config = json.loads((path / "config.json").read_text())
        parent = parent_config(path, config)
        reading = read(engine, config, safetensors_header(path / "model.safetensors"), verifier, version, parent,
                       training_config(path, config, parent))
        readings.append((reading, path))
    return readings


def _describe(reading: EngineReading, path: Path) -> str:
    lines = [f"{reading.engine} {reading.version} ({path}): {'REFUSED' if reading.refused else 'ok'}",
             f"  rules: {reading.rules}"]
    if reading.capture_layers is not None:
        lines.append(f"  captures the inputs of verifier layers {reading.capture_layers} ({reading.capture_source})")
    elif reading.capture_default:
        lines.append(f"  captures {reading.capture_source}")
    if reading.ignored:
        lines.append(f"  ignores: {', '.join(reading.ignored)}")
    lines += [f"  note: {n}" for n in reading.notes]
    lines += [f"  refused: {r}\n    (as {s})" for r, s in zip(reading.refused, reading.sources, strict=True)]
    return "\n".join(lines)


def _smoke(reading: EngineReading, path: Path, verifier: Path, prompt: str | None, ids: list[int] | None,
           floor: float) -> dict | None:
    """The smoke decode's answer (None where there is no engine export to decode), its failure or an acceptance
    under the floor added to the reading's refusals."""
    engine_dir = path.parent if "speculators_model_type" in json.loads((path / "config.json").read_text()) else path
    if not (engine_dir / "model.safetensors").is_file() or reading.capture_layers is None:
        reading.notes.append("no smoke decode: no engine export beside this speculators export")
        return None
    try:
        smoke = smoke_decode(engine_dir, verifier, reading.capture_layers, prompt, ids, floor)
    except Exception as exc:  # noqa: BLE001 - whatever breaks the decode is the reason the export is refused
        reading.refuse(f"the smoke decode failed: {type(exc).__name__}: {exc}", SMOKE_SOURCE)
        return None
    if not smoke["passed"]:
        reading.refuse(f"the smoke decode accepted the draft's first proposal in {smoke['first_acceptance']:.0%} of "
                       f"{smoke['passes']} verifier passes, under the floor of {floor:.0%}: the engine "
                       "would run a draft that does not predict this verifier (random or misread weights, "
                       "features of other layers)", SMOKE_SOURCE)
    return smoke


def _ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise typer.BadParameter("--prompt-ids: whole numbers, e.g. 1,450,22") from None
    if not ids or any(i < 0 for i in ids):
        raise typer.BadParameter("--prompt-ids: one or more token ids, none negative")
    return ids


@app.command("check-draft")
def check_draft(
    directory: Annotated[Path, typer.Argument(help="An exported draft: config.json + model.safetensors (a training "
                                              "run's output dir, or its speculators/).", exists=True, file_okay=False)],
    engine: Annotated[str | None, typer.Option(help="vllm, sglang or speculators: the engine to check for "
                                               "(default: all three).", metavar="vllm|sglang|speculators")] = None,
    engine_version: Annotated[str | None, typer.Option(
        help="The engine's release to check for, e.g. 0.22.0 (needs --engine; default: the newest release the rules "
             "were read from: vllm " + default_version("vllm") + ", sglang " + default_version("sglang")
             + ", speculators " + default_version("speculators") + ").", metavar="X")] = None,
    verifier: Annotated[Path | None, typer.Option(help="The verifier's Hugging Face directory: its sizes, RoPE, layer "
                                                  "count and architecture, and a one-prompt smoke decode (a GPU "
                                                  "where there is one) with an acceptance floor.", exists=True,
                                                  file_okay=False)] = None,
    prompt: Annotated[str | None, typer.Option(help="The smoke decode's prompt, as text (needs the verifier's "
                                               "tokenizer; without one the verifier's BOS token).")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="The smoke decode's prompt as token ids, e.g. 1,450,22 "
                                                   "(no tokenizer needed).", metavar="IDS")] = None,
    acceptance_floor: Annotated[float, typer.Option(
        help="The smoke decode's floor: the share of verifier passes that must accept the draft's first proposal "
             f"(default {ACCEPTANCE_FLOOR}; why: longrun/draft_smoke.py).", min=0.0, max=1.0)] = ACCEPTANCE_FLOOR,
    as_json: JsonFlag = False,
) -> int:
    """Replay how vLLM, SGLang and speculators (at a release) read an exported draft; refuse one they would misread."""
    begin(as_json)
    if engine is not None and engine not in ENGINES:
        raise typer.BadParameter(f"--engine: one of {', '.join(ENGINES)}, not {engine!r}")
    if engine_version is not None:
        if engine is None:
            raise typer.BadParameter("--engine-version needs --engine (a release of which engine?)")
        try:
            parse_version(engine_version)
        except ValueError as exc:
            raise typer.BadParameter(f"--engine-version: {exc}") from exc
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise typer.BadParameter(f"{directory} has no config.json and model.safetensors")
    ids = _ids(prompt_ids)
    if verifier is not None and not (verifier / "config.json").is_file():
        raise typer.BadParameter(f"--verifier {verifier} has no config.json")
    try:
        checked = check(directory, (engine,) if engine else None, verifier, engine_version)
    except (ValueError, OSError) as exc:  # a config or safetensors header that cannot be read
        raise typer.BadParameter(f"{directory}: {exc}") from exc
    answers: list[dict] = []
    for reading, path in checked:
        smoke = None
        if verifier is not None and not reading.refused:
            smoke = _smoke(reading, path, verifier, prompt, ids, acceptance_floor)
        answers.append({**asdict(reading), "directory": str(path), **({"smoke_decode": smoke} if smoke else {})})
    refused = any(r.refused for r, _ in checked)
    human = "\n".join(escape(_describe(r, p)) + (
        f"\n  smoke decode: {a['smoke_decode']['mean_accepted']} tokens per verifier pass over "
        f"{a['smoke_decode']['passes']} passes, first proposal accepted in {a['smoke_decode']['first_acceptance']:.0%} "
        f"(floor {acceptance_floor:.0%})" if "smoke_decode" in a else "")
        for (r, p), a in zip(checked, answers, strict=True))
    emit({"directory": str(directory), "engines": answers, "ok": not refused}, as_json, human)
    if refused:
        raise typer.Exit(int(ExitCode.USAGE))
    return ExitCode.OK
