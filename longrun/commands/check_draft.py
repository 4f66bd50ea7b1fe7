"""`longrun check-draft DIR [--engine vllm|sglang|speculators] [--verifier V]`: before serving, replay how each engine
reads an exported EAGLE-3 draft (its config keys and weight names), say which verifier layers it will capture and
which of the draft's settings it ignores, and refuse an export it would misread without an error.

Each engine's reading is written from its source (public repositories, the commits named):

- vLLM. Capture layers: vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ da84445 and
  vllm/v1/worker/gpu_model_runner.py @ 4e17906: the top-level `eagle_aux_hidden_state_layer_ids`, else
  `eagle_config`'s, taken as inputs of layers; none: the verifier's (2, N // 2, N - 3). Weights:
  vllm/model_executor/models/llama_eagle3.py @ 00bd149: `midlayer.` -> `layers.0.`, `d2t` -> draft_id_to_target_id
  (skipped when absent: the zeros map draft id i to target id i), `t2d` dropped, `embed_tokens` optional, any
  other unknown name an error at load (AutoWeightsLoader); reads `norm_before_residual` (default false), not
  `fc_norm` / `norm_output`. speculators' format: vllm/transformers_utils/configs/speculators/algos.py @ cfb173a
  (`update_eagle3`: draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids and
  `norm_before_residual`, taken as TRUE when absent; nothing else of speculators' flags).
- SGLang. Capture layers: python/sglang/srt/model_executor/model_runner.py @ 01cc04e:
  `eagle_config["eagle_aux_hidden_state_layer_ids"]` as outputs of layers (it captures the input of id + 1); none:
  (2, N // 2, N - 3); the top-level key is not read. Weights: python/sglang/srt/models/llama_eagle3.py @ 03d5a77:
  `d2t` -> hot_token_id (absent: none, the draft's ids taken as target ids), `t2d` dropped, every name that is not
  one of its parameters skipped without a word (so `fc_norm.*` is lost); reads neither `fc_norm` nor `norm_output`.
  Architectures: `LlamaForCausalLMEagle3` only (not speculators' `Eagle3DraftModel`).
- speculators 0.9.0 (pip), src/speculators/models/eagle3/core.py and config.py, src/speculators/model.py:
  its own format only (`speculators_model_type`; other checkpoints go through its converter, which writes
  `eagle_aux_hidden_state_layer_ids: null`); null ids: (2, N // 2, N - 3) of the verifier; reads `fc_norm`,
  `norm_output`, `norm_before_fc`, `norm_before_residual`; weights `layers.0.*`; `d2t`, `t2d` and
  `embed_tokens.weight` may be missing without an error, and then hold zeros (d2t) or uninitialised memory
  (the embedding: it loads the verifier's only where the weight is NaN).

Nothing here imports torch: reading is json and the safetensors header. The smoke decode (`--verifier`) loads the
trainer's evaluate code, and torch, when it runs.
"""

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from longrun.commands.common import JsonFlag, begin, emit
from longrun.exit_codes import ExitCode

app = typer.Typer()

ENGINES = ("vllm", "sglang", "speculators")
EAGLE31_FLAGS = ("fc_norm", "norm_output", "norm_before_fc")


@dataclass
class EngineReading:
    engine: str
    capture_layers: list[int] | None = None  # inputs of verifier layers the engine will capture
    capture_source: str = ""  # the key it took them from, or "default"
    ignored: list[str] = field(default_factory=list)  # the draft's settings this engine does not read
    refused: list[str] = field(default_factory=list)  # why serving this export there would go wrong
    notes: list[str] = field(default_factory=list)


def safetensors_names(path: Path) -> set[str]:
    """The tensor names in a safetensors file, from its header (8-byte length, then JSON)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        header = json.loads(f.read(length))
    return {name for name in header if name != "__metadata__"}


def default_layers(verifier_layers: int | None) -> list[int] | None:
    return None if verifier_layers is None else [2, verifier_layers // 2, verifier_layers - 3]


def verifier_layer_count(verifier: Path | None) -> int | None:
    if verifier is None:
        return None
    config = json.loads((verifier / "config.json").read_text())
    return (config.get("text_config") or config).get("num_hidden_layers")


def _check_layers(reading: EngineReading, trained: list[int] | None, verifier_layers: int | None) -> None:
    if reading.capture_layers is None:
        reading.refused.append(f"{reading.engine} finds no capture layer ids and falls back to the verifier's "
                               "(2, N/2, N-3); pass --verifier to name them, and make sure the draft was trained on "
                               "those")
        return
    if trained is not None and reading.capture_layers != trained:
        reading.refused.append(f"{reading.engine} captures layers {reading.capture_layers} ({reading.capture_source}) "
                               f"but the draft was trained on {trained}")
    if verifier_layers is not None and any(i < 0 or i > verifier_layers for i in reading.capture_layers):
        reading.refused.append(f"layer ids {reading.capture_layers} are outside the verifier's 0..{verifier_layers}")


def _vocab(reading: EngineReading, config: dict, names: set[str], engine_effect: str) -> None:
    draft_vocab, vocab = config.get("draft_vocab_size"), config.get("vocab_size")
    if "d2t" not in names and draft_vocab is not None and draft_vocab != vocab:
        reading.refused.append(f"model.safetensors has no d2t: {reading.engine} {engine_effect} "
                               f"(draft vocab {draft_vocab} of {vocab})")


def _eagle31(reading: EngineReading, config: dict, names: set[str]) -> None:
    for flag in EAGLE31_FLAGS:
        if config.get(flag):
            reading.ignored.append(flag)
            reading.refused.append(f"{flag} is on and {reading.engine} does not read it: it would run another "
                                   "draft than the one trained")
    if any(n.startswith("fc_norm.") for n in names) and not config.get("fc_norm"):
        reading.refused.append("fc_norm.* weights without fc_norm in the config")


def read_vllm(config: dict, names: set[str], verifier_layers: int | None) -> EngineReading:
    reading = EngineReading("vllm")
    if "speculators_model_type" in config:
        layer = config.get("transformer_layer_config") or {}
        flat = {**layer, "draft_vocab_size": config.get("draft_vocab_size"),
                "norm_before_residual": config.get("norm_before_residual", True)}
        if "norm_before_residual" not in config:
            reading.refused.append("speculators config without norm_before_residual: vLLM takes it as true")
        elif config["norm_before_residual"]:
            reading.notes.append("norm_before_residual: true (longrun trains false)")
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        source = "eagle_aux_hidden_state_layer_ids"
        _eagle31(reading, config, names)
    else:
        flat = config
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        source = "eagle_aux_hidden_state_layer_ids"
        if not (ids and isinstance(ids, list)):
            ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            source = "eagle_config.eagle_aux_hidden_state_layer_ids"
        _eagle31(reading, config, names)
        if config.get("norm_before_residual"):
            reading.notes.append("norm_before_residual: true (longrun trains false)")
    if ids and isinstance(ids, list):
        reading.capture_layers, reading.capture_source = list(ids), source
    elif verifier_layers is not None:
        reading.notes.append("no layer ids: vLLM captures the verifier's default layers")
    _vocab(reading, flat, names, "keeps a zero draft-to-target map and proposes draft ids as target ids")
    return reading


def read_sglang(config: dict, names: set[str], verifier_layers: int | None) -> EngineReading:
    reading = EngineReading("sglang")
    if "speculators_model_type" in config or "LlamaForCausalLMEagle3" not in (config.get("architectures") or []):
        reading.refused.append(f"SGLang loads LlamaForCausalLMEagle3 drafts, not {config.get('architectures')}: "
                               "serve the engine export (the directory above speculators/)")
        return reading
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list):
        reading.capture_layers = [i + 1 for i in ids]  # outputs of layers: it captures the input of id + 1
        reading.capture_source = "eagle_config.eagle_aux_hidden_state_layer_ids (+1)"
    if config.get("eagle_aux_hidden_state_layer_ids") and not isinstance(ids, list):
        reading.ignored.append("eagle_aux_hidden_state_layer_ids (top level)")
    _eagle31(reading, config, names)
    if any(n.startswith("fc_norm.") for n in names):
        reading.notes.append("fc_norm.* weights are skipped without an error")
    _vocab(reading, config, names, "has no hot-token map and proposes draft ids as target ids")
    return reading


def read_speculators(config: dict, names: set[str], verifier_layers: int | None) -> EngineReading:
    reading = EngineReading("speculators")
    if "speculators_model_type" not in config:
        reading.refused.append("not speculators' format: its converter would write eagle_aux_hidden_state_layer_ids "
                               "null; train with --export-format speculators and check DIR/speculators")
        return reading
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        reading.capture_layers, reading.capture_source = list(ids), "eagle_aux_hidden_state_layer_ids"
    else:
        reading.capture_layers, reading.capture_source = default_layers(verifier_layers), "default (2, N/2, N-3)"
    if "embed_tokens.weight" not in names:
        reading.refused.append("model.safetensors has no embed_tokens.weight: speculators' from_pretrained keeps "
                               "uninitialised memory for the embedding")
    if not any(n.startswith("layers.0.") for n in names):
        reading.refused.append("no layers.0.* weights (speculators' names for the decoder layer)")
    if config.get("fc_norm") and not all(f"fc_norm.{i}.weight" in names for i in range(3)):
        reading.refused.append("fc_norm is on but fc_norm.{0,1,2}.weight are missing")
    layer = config.get("transformer_layer_config") or {}
    _vocab(reading, {"draft_vocab_size": config.get("draft_vocab_size"), "vocab_size": layer.get("vocab_size")},
           names, "keeps d2t at zeros")
    return reading


READERS = {"vllm": read_vllm, "sglang": read_sglang, "speculators": read_speculators}


def trained_layers(config: dict) -> list[int] | None:
    """The layers the draft was trained on, where longrun recorded them (its own key, inputs of layers)."""
    ids = config.get("aux_hidden_state_layer_ids")
    return list(ids) if isinstance(ids, list) else None


def _read(directory: Path) -> tuple[dict, set[str]]:
    return json.loads((directory / "config.json").read_text()), safetensors_names(directory / "model.safetensors")


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


def check(directory: Path, engines: tuple[str, ...] | None = None, verifier: Path | None = None
          ) -> list[tuple[EngineReading, Path]]:
    """Each engine's reading of the export, with the directory it read."""
    layers = verifier_layer_count(verifier)
    readings = []
    for engine, path in engine_directories(directory, engines).items():
        config, names = _read(path)
        trained = trained_layers(config)
        if trained is None and (path.parent / "config.json").is_file():  # longrun's engine export beside speculators/
            trained = trained_layers(json.loads((path.parent / "config.json").read_text()))
        reading = READERS[engine](config, names, layers)
        if not reading.refused or reading.capture_layers is not None:
            _check_layers(reading, trained, layers)
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
    lines = [f"{reading.engine} ({path}): {'REFUSED' if reading.refused else 'ok'}"]
    if reading.capture_layers is not None:
        lines.append(f"  captures the inputs of verifier layers {reading.capture_layers} ({reading.capture_source})")
    if reading.ignored:
        lines.append(f"  ignores: {', '.join(reading.ignored)}")
    lines += [f"  note: {n}" for n in reading.notes] + [f"  refused: {r}" for r in reading.refused]
    return "\n".join(lines)


@app.command("check-draft")
def check_draft(
    directory: Annotated[Path, typer.Argument(help="An exported draft: config.json + model.safetensors (a training "
                                              "run's output dir, or its speculators/).", exists=True, file_okay=False)],
    engine: Annotated[str | None, typer.Option(help="vllm, sglang or speculators: the engine to check for "
                                               "(default: all three).", metavar="vllm|sglang|speculators")] = None,
    verifier: Annotated[Path | None, typer.Option(help="The verifier's Hugging Face directory: its layer count, and "
                                                  "a one-prompt smoke decode on the CPU.", exists=True,
                                                  file_okay=False)] = None,
    prompt: Annotated[str, typer.Option(help="The smoke decode's prompt.")] = "def fibonacci(n):",
    as_json: JsonFlag = False,
) -> int:
    """Replay how vLLM, SGLang and speculators read an exported draft; refuse one they would misread silently."""
    begin(as_json)
    if engine is not None and engine not in ENGINES:
        raise typer.BadParameter(f"--engine: one of {', '.join(ENGINES)}, not {engine!r}")
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise typer.BadParameter(f"{directory} has no config.json and model.safetensors")
    checked = check(directory, (engine,) if engine else None, verifier)
    readings = [reading for reading, _ in checked]
    result: dict = {"directory": str(directory), "engines": [{**asdict(r), "directory": str(p)} for r, p in checked]}
    if verifier is not None:
        for (reading, path), answer in zip(checked, result["engines"], strict=True):
            if reading.capture_layers is not None and not reading.refused:
                answer["smoke_decode"] = smoke_decode(path, verifier, reading.capture_layers, prompt)
    refused = any(r.refused for r in readings)
    human = "\n".join(_describe(r, p) + (f"\n  smoke decode: {a['smoke_decode']['mean_accepted']} tokens per verifier "
                                       f"pass over {a['smoke_decode']['passes']} passes" if "smoke_decode" in a else "")
                      for (r, p), a in zip(checked, result["engines"], strict=True))
    result["ok"] = not refused
    emit(result, as_json, human)
    if refused:
        raise typer.Exit(int(ExitCode.USAGE))
    return ExitCode.OK
