"""The engines' readings of a draft (longrun/draft_rules.py), on exports written by longrun's own exporter
(trainer.model: engine format and speculators' format, EAGLE 3 and 3.1) of a tiny untrained draft, and on broken
copies made from them here: every good export is accepted by each engine release that reads it, every broken one is
refused with its reason, per engine and release."""

# torch, safetensors' torch API and the trainer's model are imported where the exports are written and read, not at
# collection: the pytest processes that collect this module and never run it (the PostgreSQL lane's) skip torch

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from longrun.cli import main
from longrun.commands.check_draft import check
from longrun.draft_engines import read
from longrun.draft_releases import READ_RELEASES, parse_version
from longrun.draft_rules import safetensors_header

VERIFIER = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256}
DRAFT_VOCAB = 40
TRAINED = [2, 4, 5]  # longrun's default for 8 layers: (2, N/2, N-3)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    import torch

    from trainer.model import DraftConfig, EagleDraft, save_draft, save_speculators_draft

    root = tmp_path_factory.mktemp("draft_rules")
    (root / "verifier").mkdir()
    (root / "verifier" / "config.json").write_text(json.dumps(VERIFIER))
    for name, eagle31 in (("eagle3", False), ("eagle31", True)):
        config = DraftConfig.from_verifier(VERIFIER, DRAFT_VOCAB, ttt_steps=1, fc_norm=eagle31, norm_output=eagle31)
        torch.manual_seed(0)
        draft = EagleDraft(config, torch.randn(VERIFIER["vocab_size"], VERIFIER["hidden_size"]))
        save_draft(draft, root / name, dtype=torch.bfloat16)
        save_speculators_draft(draft, root / name / "speculators", dtype=torch.bfloat16,
                               verifier_path=root / "verifier")
    return {"eagle3": root / "eagle3", "eagle31": root / "eagle31", "verifier": root / "verifier"}


def readings(directory: Path, engine: str, verifier: Path, version: str | None = None):
    ((reading, _),) = check(directory, (engine,), verifier, version)
    return reading


def variant(src: Path, dst: Path, *, rename: dict[str, str] | None = None, drop: tuple[str, ...] = (),
            add: dict[str, tuple[int, ...]] | None = None, reshape: dict[str, Callable] | None = None,
            config: Callable[[dict], None] | None = None) -> Path:
    """A copy of the export `src` with tensors renamed, dropped, added (`add`: name -> shape, a tensor of ones) or
    reshaped and its config edited."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("speculators"))
    state = load_file(str(dst / "model.safetensors"))
    for old, new in (rename or {}).items():
        state[new] = state.pop(old)
    for name in drop:
        del state[name]
    state.update({name: torch.ones(shape) for name, shape in (add or {}).items()})
    for name, change in (reshape or {}).items():
        state[name] = change(state[name]).contiguous()
    save_file(state, str(dst / "model.safetensors"))
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data))
    return dst


def all_versions(engine: str) -> list[str]:
    return list(READ_RELEASES[engine])


def test_good_eagle3_exports_are_accepted_by_every_release_read(exports):
    for engine in ("vllm", "sglang"):
        for version in all_versions(engine):
            reading = readings(exports["eagle3"], engine, exports["verifier"], version)
            assert reading.refused == [], (engine, version, reading.refused)
            assert reading.capture_layers == TRAINED
    for engine in ("vllm", "speculators"):  # speculators' format is read by vLLM and speculators, not by SGLang
        for version in all_versions(engine):
            reading = readings(exports["eagle3"] / "speculators", engine, exports["verifier"], version)
            assert reading.refused == [] and reading.capture_layers == TRAINED, (engine, version, reading.refused)


@pytest.mark.parametrize(("engine", "speculators_format", "first_reading"), [
    ("vllm", False, "0.22.0"), ("vllm", True, "0.25.0"), ("sglang", False, "0.5.12"), ("speculators", True, "0.9.0"),
])
def test_eagle31_is_accepted_from_the_release_that_reads_fc_norm_and_norm_output(exports, engine,
                                                                                 speculators_format, first_reading):
    directory = exports["eagle31"] / "speculators" if speculators_format else exports["eagle31"]
    for version in all_versions(engine):
        reading = readings(directory, engine, exports["verifier"], version)
        if parse_version(version) >= parse_version(first_reading):
            assert reading.refused == [], (version, reading.refused)
        else:
            assert set(reading.ignored) == {"fc_norm", "norm_output"}
            assert any(r.startswith(f"norm_output is on and {engine} {version} does not read it (it is read from "
                                    f"{engine} {first_reading}") for r in reading.refused), reading.refused
            assert len(reading.sources) == len(reading.refused)


def test_an_eagle31_export_for_an_engine_before_fc_norm_fails_to_load_or_loses_the_norms(exports):
    vllm = readings(exports["eagle31"], "vllm", exports["verifier"], "0.21.0")
    sglang = readings(exports["eagle31"], "sglang", exports["verifier"], "0.5.11")
    assert any("fc_norm.0.weight is not a parameter" in r and "vLLM stops at load" in r for r in vllm.refused)
    assert any("fc_norm.0.weight is not a parameter" in r and "SGLang skips it without a word" in r
               for r in sglang.refused)


Q = "midlayer.self_attn.q_proj.weight"
ENGINE_BROKEN = {
    # name: (how the copy is made, {engine: the reason's words})
    "renamed_q_proj": (dict(rename={Q: "midlayer.self_attn.query.weight"}), {
        "sglang": ["midlayer.self_attn.query.weight is not a parameter of the draft sglang builds: SGLang skips it "
                   "without a word", f"model.safetensors has no {Q}: SGLang leaves that parameter uninitialised"],
        "vllm": ["midlayer.self_attn.query.weight is not a parameter of the draft vllm builds: vLLM stops at load"]}),
    "renamed_fc": (dict(rename={"fc.weight": "fc_in.weight"}), {
        "sglang": ["fc_in.weight is not a parameter", "SGLang skips it without a word",
                   "model.safetensors has no fc.weight"],
        "vllm": ["fc_in.weight is not a parameter", "vLLM stops at load"]}),
    "missing_tensor": (dict(drop=("midlayer.mlp.down_proj.weight",)), {
        "sglang": ["model.safetensors has no midlayer.mlp.down_proj.weight: SGLang leaves that parameter "
                   "uninitialised"],
        "vllm": ["model.safetensors has no midlayer.mlp.down_proj.weight: vLLM leaves that parameter uninitialised"]}),
    "missing_lm_head": (dict(drop=("lm_head.weight",)), {
        "sglang": ["model.safetensors has no lm_head.weight"],
        "vllm": ["model.safetensors has no lm_head.weight: vLLM shares the verifier's lm_head"]}),
    "extra_tensor": (dict(add={"midlayer.self_attn.q_norm.weight": (8,)}), {
        "sglang": ["midlayer.self_attn.q_norm.weight is not a parameter", "SGLang skips it without a word"],
        "vllm": ["midlayer.self_attn.q_norm.weight is not a parameter", "vLLM stops at load"]}),
    "wrong_shape": (dict(reshape={"lm_head.weight": lambda t: t[: DRAFT_VOCAB - 1]}), {
        "sglang": [f"lm_head.weight is [{DRAFT_VOCAB - 1}, 32]", f"it needs [{DRAFT_VOCAB}, 32]",
                   "SGLang's weight loader asserts the shape"],
        "vllm": [f"lm_head.weight is [{DRAFT_VOCAB - 1}, 32]", "vLLM's weight loader asserts the shape"]}),
    "tied_embeddings": (dict(config=lambda c: c.update(tie_word_embeddings=True)), {
        "sglang": ["tie_word_embeddings is true: SGLang makes lm_head the embedding",
                   "lm_head.weight is not a parameter of the draft sglang builds"]}),
    "layer_ids_out_of_range": (dict(config=lambda c: (c.update(eagle_aux_hidden_state_layer_ids=[2, 4, 9]),
                                                      c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 7]))), {
        "vllm": ["layer ids [2, 4, 9] (eagle_aux_hidden_state_layer_ids) are outside the 0..8 vllm can capture",
                 f"vllm captures layers [2, 4, 9] (eagle_aux_hidden_state_layer_ids) but the draft was trained on "
                 f"{TRAINED}"],
        "sglang": ["layer ids [2, 4, 8] (eagle_config.eagle_aux_hidden_state_layer_ids (+1)) are outside the 1..7 "
                   "sglang can capture"]}),
    # before vLLM 0.22.0 / SGLang 0.5.12 fc reads 3 features; from them as many as eagle_config names
    "layer_ids_wrong_count": (dict(config=lambda c: (c.update(eagle_aux_hidden_state_layer_ids=[2, 4]),
                                                     c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3]))), {
        "vllm": (["vllm captures 2 layers [2, 4] but fc reads 3 features"], ["fc.weight is [32, 96]", "[32, 64]"]),
        "sglang": (["sglang captures 2 layers [2, 4] but fc reads 3 features"], ["fc.weight is [32, 96]", "[32, 64]"])}),
    "wrong_vocab": (dict(config=lambda c: c.update(vocab_size=120)), {
        "vllm": ["the draft's vocab_size is 120 and the verifier's 100"],
        "sglang": ["the draft's vocab_size is 120 and the verifier's 100"]}),
    "wrong_hidden": (dict(config=lambda c: c.update(hidden_size=48, target_hidden_size=48, head_dim=8)), {
        "vllm": ["fc.weight is [32, 96]", "it needs [48, 144]", "fc reads features of 48 but the verifier's hidden "
                 "size is 32"],
        "sglang": ["fc.weight is [32, 96]", "the draft's hidden_size is 48; sglang feeds it the verifier's embedding"]}),
}


@pytest.mark.parametrize("broken", sorted(ENGINE_BROKEN))
def test_a_broken_engine_export_is_refused_with_its_reason(exports, tmp_path, broken):
    how, reasons = ENGINE_BROKEN[broken]
    bad = variant(exports["eagle3"], tmp_path / broken, **how)
    for engine, words in reasons.items():
        alternatives = words if isinstance(words, tuple) else (words,)  # the reason differs between releases
        for version in all_versions(engine):
            reading = readings(bad, engine, exports["verifier"], version)
            text = " | ".join(reading.refused)
            assert any(all(w in text for w in alt) for alt in alternatives), (engine, version, text)
            assert len(reading.sources) == len(reading.refused) and all(reading.sources)


def test_vllm_reads_tied_embeddings_right_and_says_it_ignores_the_flag(exports, tmp_path):
    bad = variant(exports["eagle3"], tmp_path / "tied", config=lambda c: c.update(tie_word_embeddings=True))
    reading = readings(bad, "vllm", exports["verifier"])
    assert reading.refused == [] and "tie_word_embeddings" in reading.ignored


def test_speculators_layer_names_are_skipped_by_sglang_before_0_5_12(exports, tmp_path):
    """Some trainers write the engine export's layer as `layers.0.*`: vLLM and SGLang >= 0.5.12 map `midlayer` to it,
    SGLang 0.5.11 has only `midlayer` and skips those names without a word."""
    from safetensors.torch import load_file

    state = load_file(str(exports["eagle3"] / "model.safetensors"))
    renamed = {n: n.replace("midlayer.", "layers.0.") for n in state if n.startswith("midlayer.")}
    bad = variant(exports["eagle3"], tmp_path / "layers0", rename=renamed)
    assert readings(bad, "vllm", exports["verifier"], "0.21.0").refused == []
    assert readings(bad, "sglang", exports["verifier"], "0.5.12").refused == []
    old = readings(bad, "sglang", exports["verifier"], "0.5.11")
    assert any(r.startswith("layers.0.self_attn.q_proj.weight is not a parameter") for r in old.refused)
    assert any(r.startswith(f"model.safetensors has no {Q}") for r in old.refused)


SPECULATORS_BROKEN = {
    "renamed_q_proj": (dict(rename={"layers.0.self_attn.q_proj.weight": "layers.0.self_attn.query.weight"}),
                       ["layers.0.self_attn.query.weight is not a parameter of the draft speculators builds: "
                        "from_pretrained drops it", "model.safetensors has no layers.0.self_attn.q_proj.weight"]),
    "missing_lm_head": (dict(drop=("lm_head.weight",)),
                        ["model.safetensors has no lm_head.weight: speculators fills it with the verifier's lm_head"]),
    "extra_tensor": (dict(add={"layers.0.extra.weight": (4,)}), ["layers.0.extra.weight is not a parameter"]),
    "wrong_shape": (dict(reshape={"fc.weight": lambda t: t[:, :64]}), ["fc.weight is [32, 64]", "it needs [32, 96]"]),
    "wrong_vocab": (dict(config=lambda c: c["transformer_layer_config"].update(vocab_size=120)),
                    ["the draft's vocab_size is 120 and the verifier's 100", "embed_tokens.weight is [100, 32]"]),
}


@pytest.mark.parametrize("broken", sorted(SPECULATORS_BROKEN))
def test_a_broken_speculators_export_is_refused_with_its_reason(exports, tmp_path, broken):
    how, words = SPECULATORS_BROKEN[broken]
    bad = variant(exports["eagle3"] / "speculators", tmp_path / broken, **how)
    text = " | ".join(readings(bad, "speculators", exports["verifier"]).refused)
    assert all(w in text for w in words), text


def test_sglang_refuses_speculators_format_and_reads_only_eagle_config_ids(exports):
    reading = readings(exports["eagle3"] / "speculators", "sglang", exports["verifier"])
    assert reading.refused[0].startswith("SGLang loads LlamaForCausalLMEagle3 drafts, not ['Eagle3DraftModel']")
    config = json.loads((exports["eagle3"] / "config.json").read_text())
    del config["eagle_config"]
    tensors = safetensors_header(exports["eagle3"] / "model.safetensors")
    sglang = read("sglang", config, tensors, None, "0.5.23")
    assert sglang.capture_layers is None and "eagle_aux_hidden_state_layer_ids (top level)" in sglang.ignored
    # vLLM before 0.22.0 reads only the top-level key; from 0.22.0 it falls back to eagle_config's ids, as they are
    config = json.loads((exports["eagle3"] / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    assert read("vllm", config, tensors, None, "0.21.0").capture_layers is None
    assert read("vllm", config, tensors, None, "0.22.0").capture_layers == [i - 1 for i in TRAINED]


def test_versions_parse_and_releases_outside_those_read_are_named():
    assert parse_version("v0.22") == (0, 22, 0) and parse_version("0.5.12.post1") == (0, 5, 12)
    assert parse_version("0.25.0rc1") == (0, 25, 0)
    with pytest.raises(ValueError):
        parse_version("latest")
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32, "num_attention_heads": 4,
              "vocab_size": 100, "intermediate_size": 64}
    newer = read("vllm", config, {}, None, "0.35.0")
    assert newer.rules.startswith("vllm 0.34.0") and "newer than the newest release read (0.34.0)" in newer.unverified
    assert newer.refused[-1] == newer.unverified  # not assumed to read drafts as 0.34.0 does: refused
    assert "older than the oldest release read" in read("sglang", config, {}, None, "0.4.0").refused[-1]
    assert read("vllm", config, {}, None, "0.23.1").rules == "vllm 0.23.0 (the release read nearest to 0.23.1)"
    assert read("vllm", config, {}, None, "0.34.0").unverified is None


def cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(["check-draft", *args])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_names_release_and_source_of_each_refusal(exports, capsys):
    code, out, _ = cli(capsys, str(exports["eagle31"]), "--engine", "vllm", "--engine-version", "0.21.0", "--json")
    (answer,) = json.loads(out)["engines"]
    assert code == 2 and answer["version"] == "0.21.0" and answer["rules"] == "vllm 0.21.0"
    assert len(answer["sources"]) == len(answer["refused"]) and all(s.startswith("vllm 0.21.0 ") for s in answer["sources"])
    code, out, _ = cli(capsys, str(exports["eagle31"]), "--engine", "vllm", "--engine-version", "0.22.0")
    assert code == 0 and "vllm 0.22.0" in out and "ok" in out
    code, _, err = cli(capsys, str(exports["eagle31"]), "--engine-version", "0.22.0")
    assert code == 2 and "--engine-version needs --engine" in err
