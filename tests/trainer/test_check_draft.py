"""`longrun check-draft`: on real exports of a tiny trained draft, each engine's reading (written from its source,
longrun/draft_engines.py; the matrix of drafts and releases is tests/unit/test_draft_matrix.py) says which layers it
captures; exports an engine would misread are refused with the reason; a verifier adds a one-prompt smoke decode,
whose failure or acceptance under its floor is a refusal too (a random draft, a transposed o_proj), and which needs
no tokenizer; the command loads no torch until it decodes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from longrun.cli import main
from longrun.draft_smoke import ACCEPTANCE_FLOOR
from tests.trainer.conftest import one_cpu_thread
from tests.trainer.tiny_setup import build_dataset, build_verifier
from trainer.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]
O_PROJ = "midlayer.self_attn.o_proj.weight"  # square: [hidden, heads x head_dim]


@pytest.fixture(scope="module")
def exports(tiny_verifier, prepared_data, tmp_path_factory) -> dict[str, Path]:
    """A plain EAGLE-3 export and an EAGLE 3.1 one, each in both formats, of drafts trained on the tiny verifier."""
    root = tmp_path_factory.mktemp("exports")
    with one_cpu_thread():
        for name, extra in (("eagle3", []), ("eagle31", ["--fc-norm", "--norm-output"])):
            assert train_main([
                "--verifier-path", str(tiny_verifier), "--data-dir", str(prepared_data / "hidden_states"),
                "--vocab-mapping-dir", str(prepared_data / "vocab_mapping"), "--output-dir", str(root / name),
                "--epochs", "6", "--lr", "3e-3", "--ttt-steps", "3", "--noise-std", "0.05", "--scheduler", "cosine",
                "--warmup-ratio", "0.05", "--max-seq-len", "64", "--num-workers", "0", "--val-ratio", "0",
                "--export-format", "engine,speculators", *extra,
            ]) == 0
    return {"eagle3": root / "eagle3", "eagle31": root / "eagle31", "verifier": tiny_verifier}


def check(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    try:
        with one_cpu_thread():
            code = main(["check-draft", *map(str, args), "--json"])
    except SystemExit as exc:
        code = exc.code
    return code, json.loads(capsys.readouterr().out)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "metrics.jsonl"))
    return dst


def trained_layers(export: Path) -> list[int]:
    return json.loads((export / "config.json").read_text())["aux_hidden_state_layer_ids"]


def test_a_good_export_passes_for_every_engine_with_a_smoke_decode(exports, capsys):
    code, answer = check(capsys, exports["eagle3"], "--verifier", exports["verifier"])
    assert code == 0 and answer["ok"]
    engines = {e["engine"]: e for e in answer["engines"]}
    assert set(engines) == {"vllm", "sglang", "speculators"}
    assert engines["speculators"]["directory"].endswith("speculators")
    for engine in engines.values():
        assert engine["capture_layers"] == trained_layers(exports["eagle3"]) and not engine["refused"]
        smoke = engine["smoke_decode"]
        assert smoke["passes"] >= 16 and smoke["first_acceptance"] >= smoke["floor"] == ACCEPTANCE_FLOOR
        assert smoke["prompt"] == "the verifier's BOS token (no tokenizer)"  # no --prompt given


@pytest.fixture(scope="module")
def partial(tmp_path_factory) -> dict[str, Path]:
    """A random sharp Llama without a tokenizer (tests/trainer/tiny_setup.py) and a draft trained on it, accepted
    often but not always: the tiny verifier's text is so regular that even a broken draft is accepted there."""
    root = tmp_path_factory.mktemp("partial")
    with one_cpu_thread():
        build_dataset(build_verifier(root / "verifier"), root / "data", samples=48)
        assert train_main([
            "--verifier-path", str(root / "verifier"), "--data-dir", str(root / "data" / "hidden_states"),
            "--vocab-mapping-dir", str(root / "data" / "vocab_mapping"), "--output-dir", str(root / "draft"),
            "--epochs", "6", "--lr", "3e-3", "--max-seq-len", "48", "--num-workers", "0", "--ttt-steps", "3",
            "--val-ratio", "0",
        ]) == 0
    return {"draft": root / "draft", "verifier": root / "verifier"}


def test_a_random_or_transposed_draft_fails_the_smoke_decode_floor(partial, tmp_path, capsys):
    """Names and shapes are right; only the numbers show these: the engines load them without a word."""
    code, answer = check(capsys, partial["draft"], "--engine", "vllm", "--verifier", partial["verifier"])
    assert code == 0 and answer["engines"][0]["smoke_decode"]["first_acceptance"] >= ACCEPTANCE_FLOOR
    for name, change in (("random", lambda s: {k: torch.randn_like(t) if t.is_floating_point() else t
                                               for k, t in s.items()}),
                         ("transposed", lambda s: {**s, O_PROJ: s[O_PROJ].t().contiguous()})):
        bad = copy(partial["draft"], tmp_path / name)
        torch.manual_seed(1)
        save_file(change(load_file(str(bad / "model.safetensors"))), str(bad / "model.safetensors"))
        assert check(capsys, bad, "--engine", "vllm")[0] == 0  # the files alone pass
        code, answer = check(capsys, bad, "--engine", "vllm", "--verifier", partial["verifier"])
        (reading,) = answer["engines"]
        assert code == 2 and not reading["smoke_decode"]["passed"], reading["smoke_decode"]
        assert reading["refused"][0].startswith("the smoke decode accepted the draft's first proposal in ")
        # an early checkpoint read right can be let through with its figures
        code, answer = check(capsys, bad, "--engine", "vllm", "--verifier", partial["verifier"],
                             "--acceptance-floor", "0")
        assert code == 0 and answer["engines"][0]["smoke_decode"]["floor"] == 0


def test_a_draft_in_specforges_layout_decodes_as_the_engines_read_it(exports, tmp_path, capsys):
    """A stock SpecForge export: no layer ids (the engines' default, the layers trained on here), RoPE only in
    rope_parameters (transformers 5's LlamaConfig), no longrun keys; for SGLang with `model.`-prefixed names."""
    bad = copy(exports["eagle3"], tmp_path / "specforge")
    config = json.loads((bad / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 5]  # the tiny verifier's default (8 layers)
    for key in ("aux_hidden_state_layer_ids", "ttt_steps", "eagle_aux_hidden_state_layer_ids", "eagle_config",
                "target_hidden_size", "fc_norm", "norm_output"):
        config.pop(key)
    config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
    (bad / "config.json").write_text(json.dumps(config))
    state = load_file(str(bad / "model.safetensors"))
    save_file({(n if n.startswith("lm_head") or n in ("d2t", "t2d") else "model." + n): t for n, t in state.items()},
              str(bad / "model.safetensors"))
    code, answer = check(capsys, bad, "--engine", "sglang", "--verifier", exports["verifier"])
    (reading,) = answer["engines"]
    assert code == 0 and reading["capture_default"] and reading["smoke_decode"]["passed"], reading


def test_the_smoke_decode_needs_no_tokenizer(exports, tmp_path, capsys):
    verifier = shutil.copytree(exports["verifier"], tmp_path / "verifier",
                               ignore=shutil.ignore_patterns("tokenizer*"))
    for extra in ([], ["--prompt-ids", "5,17,42"], ["--prompt", "def fibonacci(n):"]):
        code, answer = check(capsys, exports["eagle3"], "--engine", "sglang", "--verifier", verifier, *extra)
        (reading,) = answer["engines"]
        assert code == 0 and reading["smoke_decode"]["passed"], reading
        assert reading["smoke_decode"]["prompt"] == ("--prompt-ids" if extra[:1] == ["--prompt-ids"] else
                                                     "the verifier's BOS token (no tokenizer)")
    code, answer = check(capsys, exports["eagle3"], "--engine", "sglang", "--verifier", exports["verifier"],
                         "--prompt", "def fibonacci(n):")
    assert code == 0 and answer["engines"][0]["smoke_decode"]["prompt"] == "--prompt, tokenized"


def test_wrong_layer_ids_are_refused_naming_the_engine_and_layers(exports, tmp_path, capsys):
    bad = copy(exports["eagle3"], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]  # SGLang: inputs of 1, 3, 6
    (bad / "config.json").write_text(json.dumps(config))
    code, answer = check(capsys, bad, "--engine", "sglang")
    assert code == 2 and not answer["ok"]
    (reason,) = answer["engines"][0]["refused"]
    assert "sglang captures layers [1, 3, 6]" in reason and f"trained on {trained_layers(bad)}" in reason
    assert check(capsys, bad, "--engine", "vllm")[0] == 0  # vLLM reads the top-level key, still right

    # without the engines' keys each takes the verifier's default (2, N/2, N-3): the layers longrun trained on here
    del config["eagle_aux_hidden_state_layer_ids"], config["eagle_config"]
    (bad / "config.json").write_text(json.dumps(config))
    code, answer = check(capsys, bad, "--engine", "vllm", "--verifier", exports["verifier"])
    assert code == 0 and answer["engines"][0]["capture_layers"] == trained_layers(bad)
    code, answer = check(capsys, bad, "--engine", "vllm")  # without the verifier's layer count
    assert code == 2 and "pass --verifier to compare them" in answer["engines"][0]["refused"][0]


def test_a_missing_d2t_is_refused(exports, tmp_path, capsys):
    for fmt in ("", "speculators"):
        bad = copy(exports["eagle3"], tmp_path / f"bad{fmt}")
        weights = bad / fmt / "model.safetensors"
        state = load_file(str(weights))
        del state["d2t"]
        save_file(state, str(weights))
        code, answer = check(capsys, bad / fmt)
        assert code == 2
        refused = [r for e in answer["engines"] for r in e["refused"]]
        assert refused and all("no d2t" in r for r in refused), refused


def test_a_full_vocabulary_draft_is_exported_without_d2t_and_served_by_vllm_0_34(prepared_data, tiny_verifier,
                                                                                   tmp_path, capsys):
    """vLLM from 0.30.0 stops at a `d2t` in a draft of the verifier's whole vocabulary; the export leaves the
    identity map out, and check-draft's smoke decode reads its absence as the engines do: draft id i is target i."""
    from trainer.vocab import save_vocab_mapping

    vocab = json.loads((tiny_verifier / "config.json").read_text())["vocab_size"]
    mapping = save_vocab_mapping(tmp_path / "vocab_mapping", torch.zeros(vocab, dtype=torch.long),
                                 torch.ones(vocab, dtype=torch.bool))
    with one_cpu_thread():
        assert train_main([
            "--verifier-path", str(tiny_verifier), "--data-dir", str(prepared_data / "hidden_states"),
            "--vocab-mapping-dir", str(mapping.parent), "--output-dir", str(tmp_path / "full"), "--epochs", "6",
            "--lr", "3e-3", "--ttt-steps", "3", "--max-seq-len", "64", "--num-workers", "0", "--val-ratio", "0",
            "--export-format", "engine,speculators",
        ]) == 0
    full = tmp_path / "full"
    assert json.loads((full / "config.json").read_text())["draft_vocab_size"] == vocab
    for directory in (full, full / "speculators"):
        assert not {"d2t", "t2d"} & load_file(str(directory / "model.safetensors")).keys()
    code, answer = check(capsys, full, "--engine", "vllm", "--engine-version", "0.34.0", "--verifier", tiny_verifier)
    (reading,) = answer["engines"]
    assert code == 0 and not reading["refused"] and reading["smoke_decode"]["passed"], reading
    code, answer = check(capsys, full, "--verifier", tiny_verifier)  # SGLang and speculators too
    assert code == 0 and answer["ok"], answer


def test_eagle31_is_served_by_the_releases_that_read_it_and_refused_before(exports, capsys):
    code, answer = check(capsys, exports["eagle31"], "--verifier", exports["verifier"])
    assert code == 0 and answer["ok"], answer
    engines = {e["engine"]: e for e in answer["engines"]}
    assert set(engines) == {"vllm", "sglang", "speculators"}
    assert all(e["smoke_decode"]["passes"] > 0 for e in engines.values())
    for engine, version, first in (("vllm", "0.21.0", "0.22.0"), ("sglang", "0.5.11", "0.5.12")):
        code, answer = check(capsys, exports["eagle31"], "--engine", engine, "--engine-version", version)
        (reading,) = answer["engines"]
        assert code == 2 and set(reading["ignored"]) == {"fc_norm", "norm_output"}
        assert any(f"does not read it (it is read from {engine} {first}" in r for r in reading["refused"])
    code, answer = check(capsys, exports["eagle31"] / "speculators", "--engine", "vllm", "--engine-version", "0.24.0")
    assert code == 2 and "vllm 0.25.0 in speculators' format" in answer["engines"][0]["refused"][0]


def test_a_broken_export_is_refused_before_the_smoke_decode(exports, tmp_path, capsys):
    bad = copy(exports["eagle3"], tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"][:-1].contiguous()
    save_file(state, str(bad / "model.safetensors"))
    code, answer = check(capsys, bad, "--verifier", exports["verifier"])
    assert code == 2 and not answer["ok"]
    for engine in answer["engines"]:
        if engine["engine"] in ("vllm", "sglang"):
            assert any(r.startswith("lm_head.weight is [") for r in engine["refused"]), engine
            assert "smoke_decode" not in engine


def test_a_failing_smoke_decode_is_a_refusal_with_its_error(exports, tmp_path, capsys):
    verifier = shutil.copytree(exports["verifier"], tmp_path / "verifier")
    weights = next(verifier.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])  # its config reads fine; its weights do not load
    code, answer = check(capsys, exports["eagle3"], "--engine", "vllm", "--verifier", verifier)
    (reading,) = answer["engines"]
    assert code == 2 and not answer["ok"] and "smoke_decode" not in reading
    assert reading["refused"][0].startswith("the smoke decode failed: ")


def test_the_speculators_export_without_its_embedding_is_refused(exports, tmp_path, capsys):
    bad = copy(exports["eagle3"] / "speculators", tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    del state["embed_tokens.weight"]
    save_file(state, str(bad / "model.safetensors"))
    code, answer = check(capsys, bad, "--engine", "speculators")
    assert code == 2 and "embed_tokens.weight" in answer["engines"][0]["refused"][0]


def test_the_committed_specforge_drafts_are_what_specforge_writes(tmp_path):
    """tests/unit/test_draft_matrix.py reads drafts SpecForge 0.2.0 wrote (committed, so that the unit lane need not
    import it); written again, they hold the same config and the same tensor names, dtypes and shapes."""
    from longrun.draft_rules import safetensors_header
    from tests.fixtures.specforge_drafts.write import HERE, write

    for name, directory in write(tmp_path).items():
        config, committed = (json.loads((d / "config.json").read_text()) for d in (directory, HERE / name))
        config.pop("transformers_version"), committed.pop("transformers_version")
        assert config == committed
        assert safetensors_header(directory / "model.safetensors") == safetensors_header(HERE / name /
                                                                                         "model.safetensors")


def test_the_cli_loads_no_torch_for_its_other_commands():
    # of the trainer, only its series names (trainer/series.py, the standard library alone)
    code = ("import sys, longrun.cli; "
            "print('torch' in sys.modules, sorted(m for m in sys.modules if m.split('.')[0] == 'trainer'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False ['trainer', 'trainer.series']"
