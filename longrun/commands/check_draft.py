"""`longrun check-draft DIR [--engine vllm|sglang|speculators [--engine-version X]] [--verifier V]`: before serving,
replay how each engine release reads an exported EAGLE-3 draft (its config keys, every tensor by name and shape),
say which verifier layers it will capture and which of the draft's settings it ignores, and refuse an export it would
misread, fail to load or silently skip parts of.

The rules, and the loader code (engine release and file) each one mirrors, are in longrun/draft_rules.py: vLLM read
in its 0.21.0-0.27.0 releases (llama_eagle3.py, eagle.py, gpu_model_runner.py, speculators/algos.py; EAGLE 3.1's
fc_norm / norm_output from 0.22.0, PR #42764, and from 0.25.0 for speculators' format, PR #46488), SGLang in
0.5.11-0.5.23 (llama_eagle3.py load_weights, which skips unknown names: `if param_name in params_dict`; fc_norm /
norm_output from 0.5.12), speculators 0.9.0.

Nothing here imports torch: reading is json and the safetensors header. The smoke decode (`--verifier`) loads the
trainer's evaluate code, and torch, when it runs; its failure is a refusal with the error, not a traceback.
"""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from longrun.commands.common import JsonFlag, begin, emit
from longrun.draft_rules import (
    CAPTURE_SOURCES,
    ENGINES,
    EngineReading,
    Verifier,
    default_version,
    parse_version,
    read,
    read_verifier,
    safetensors_header,
)
from longrun.exit_codes import ExitCode

app = typer.Typer()

def _check_layers(reading: EngineReading, trained: list[int] | None) -> None:
    if reading.capture_layers is None:
        reading.refuse(f"{reading.engine} finds no capture layer ids and falls back to the verifier's "
                       "(2, N/2, N-3); pass --verifier to name them, and make sure the draft was trained on those",
                       CAPTURE_SOURCES[reading.engine])
        return
    if trained is not None and reading.capture_layers != trained:
        reading.refuse(f"{reading.engine} captures layers {reading.capture_layers} ({reading.capture_source}) "
                       f"but the draft was trained on {trained} (longrun's aux_hidden_state_layer_ids)",
                       CAPTURE_SOURCES[reading.engine])


def trained_layers(config: dict) -> list[int] | None:
    """The layers the draft was trained on, where longrun recorded them (its own key, inputs of layers)."""
    ids = config.get("aux_hidden_state_layer_ids")
    return list(ids) if isinstance(ids, list) else None


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


def check(directory: Path, engines: tuple[str, ...] | None = None, verifier: Path | Verifier | None = None,
          version: str | None = None) -> list[tuple[EngineReading, Path]]:
    """Each engine's reading of the export, with the directory it read (`version`: that of the one engine named)."""
    verifier = verifier if isinstance(verifier, Verifier) or verifier is None else read_verifier(verifier)
    readings = []
    for engine, path in engine_directories(directory, engines).items():
        config = json.loads((path / "config.json").read_text())
        trained = trained_layers(config)
        if trained is None and (path.parent / "config.json").is_file():  # longrun's engine export beside speculators/
            trained = trained_layers(json.loads((path.parent / "config.json").read_text()))
        reading = read(engine, config, safetensors_header(path / "model.safetensors"), verifier, version)
        if not reading.refused or reading.capture_layers is not None:
            _check_layers(reading, trained)
        readings.append((reading, path))
    return readings


def smoke_decode(directory: Path, verifier: Path, capture: list[int], prompt: str, depth: int = 3,
                 new_tokens: int = 24) -> dict:
    """One greedy speculative decode of `prompt` with the draft fed the layers the engine captures; returns the
    tokens accepted per verifier pass. Loads torch and the trainer here, not at import."""
    import torch  # noqa: PLC0415

    from trainer.evaluate import DecodeStats, DraftProposer, Verifier, speculative_decode  # noqa: PLC0415
    from trainer.model import load_draft  # noqa: PLC0415
    from trainer.verifier_model import load_verifier  # noqa: PLC0415

    speculators_format = "speculators_model_type" in json.loads((directory / "config.json").read_text())
    engine_dir = directory.parent if speculators_format else directory  # the draft's weights as longrun reads them
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_verifier(str(verifier), device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    draft = load_draft(engine_dir, model.get_input_embeddings().weight.detach()).to(device).eval()
    stats = DecodeStats()
    ids = tokenizer(prompt)["input_ids"]
    out = speculative_decode(Verifier(model, capture), DraftProposer(draft), ids, depth, new_tokens,
                             getattr(tokenizer, "eos_token_id", None), stats)
    return {"prompt_tokens": len(ids), "new_tokens": len(out), "passes": stats.passes,
            "mean_accepted": round(stats.mean_accepted(depth), 3), "depth": depth}


def _describe(reading: EngineReading, path: Path) -> str:
    lines = [f"{reading.engine} {reading.version} ({path}): {'REFUSED' if reading.refused else 'ok'}",
             f"  rules: {reading.rules}"]
    if reading.capture_layers is not None:
        lines.append(f"  captures the inputs of verifier layers {reading.capture_layers} ({reading.capture_source})")
    if reading.ignored:
        lines.append(f"  ignores: {', '.join(reading.ignored)}")
    lines += [f"  note: {n}" for n in reading.notes]
    lines += [f"  refused: {r}\n    (as {s})" for r, s in zip(reading.refused, reading.sources, strict=True)]
    return "\n".join(lines)


def _smoke(reading: EngineReading, path: Path, verifier: Path, prompt: str) -> dict | None:
    """The smoke decode's answer, or None with its failure added to the reading's refusals."""
    try:
        return smoke_decode(path, verifier, reading.capture_layers or [], prompt)
    except Exception as exc:  # noqa: BLE001 - whatever breaks the decode is the reason the export is refused
        reading.refuse(f"the smoke decode failed: {type(exc).__name__}: {exc}",
                       "longrun's decode of the draft with the verifier (trainer.evaluate.speculative_decode)")
        return None


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
    verifier: Annotated[Path | None, typer.Option(help="The verifier's Hugging Face directory: its sizes and layer "
                                                  "count, and a one-prompt smoke decode on the CPU.", exists=True,
                                                  file_okay=False)] = None,
    prompt: Annotated[str, typer.Option(help="The smoke decode's prompt.")] = "def fibonacci(n):",
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
    if verifier is not None and not (verifier / "config.json").is_file():
        raise typer.BadParameter(f"--verifier {verifier} has no config.json")
    try:
        checked = check(directory, (engine,) if engine else None, verifier, engine_version)
    except (ValueError, OSError) as exc:  # a config or safetensors header that cannot be read
        raise typer.BadParameter(f"{directory}: {exc}") from exc
    answers: list[dict] = []
    for reading, path in checked:
        smoke = None
        if verifier is not None and reading.capture_layers is not None and not reading.refused:
            smoke = _smoke(reading, path, verifier, prompt)
        answers.append({**asdict(reading), "directory": str(path), **({"smoke_decode": smoke} if smoke else {})})
    refused = any(r.refused for r, _ in checked)
    human = "\n".join(escape(_describe(r, p)) + (
        f"\n  smoke decode: {a['smoke_decode']['mean_accepted']} tokens per verifier pass over "
        f"{a['smoke_decode']['passes']} passes" if "smoke_decode" in a else "")
        for (r, p), a in zip(checked, answers, strict=True))
    emit({"directory": str(directory), "engines": answers, "ok": not refused}, as_json, human)
    if refused:
        raise typer.Exit(int(ExitCode.USAGE))
    return ExitCode.OK
