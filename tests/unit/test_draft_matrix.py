"""check-draft's matrix: valid and one-defect drafts against every engine release read (vLLM 0.21.0-0.34.0, SGLang
0.5.11-0.5.23, speculators 0.9.0). The drafts are written by longrun's own exporter and by SpecForge 0.2.0's own
draft model and export helper (committed: tests/fixtures/specforge_drafts/write.py), at a tiny size; each verdict is set against what that release's loader does with the
draft (read from its wheel, longrun/draft_releases.py), written here independently of the rules: 0 valid drafts
refused, 0 refused drafts passed, and the misreads passed only where neither the files nor anything but the smoke
decode can show them (docs/check-draft.md names them and holds this summary)."""

import json
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from longrun.commands.check_draft import check
from longrun.draft_releases import READ_RELEASES, parse_version
from longrun.draft_rules import Verifier

VERIFIER = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 256}
DRAFT_VOCAB = 40
SPECFORGE_DRAFTS = Path(__file__).resolve().parents[1] / "fixtures" / "specforge_drafts"
PASS, REFUSE, SMOKE = "pass", "refuse", "smoke"  # SMOKE: a misread only the smoke decode shows


def v(text: str) -> tuple[int, ...]:
    return parse_version(text)


def longrun_export(root: Path, name: str, *, eagle31: bool = False, draft_vocab: int = DRAFT_VOCAB) -> Path:
    import torch

    from trainer.model import DraftConfig, EagleDraft, save_draft, save_speculators_draft

    config = DraftConfig.from_verifier(VERIFIER, draft_vocab, ttt_steps=1, fc_norm=eagle31, norm_output=eagle31)
    torch.manual_seed(0)
    draft = EagleDraft(config, torch.randn(VERIFIER["vocab_size"], VERIFIER["hidden_size"]))
    save_draft(draft, root / name, dtype=torch.bfloat16)
    save_speculators_draft(draft, root / name / "speculators", dtype=torch.bfloat16, verifier_path=root / "verifier")
    return root / name


def specforge_export(root: Path, name: str, *, eagle_ids: list[int] | None = None, embed: bool = False,
                     rope_theta: float | None = None) -> Path:
    """A draft written by SpecForge 0.2.0's code (tests/fixtures/specforge_drafts/write.py: export/to_sglang.py's
    way, or with `embed` export/to_hf.py's), its draft config given eagle_config's capture layers (`eagle_ids`, as
    SpecForge's LlamaConfig writes them) or another rope_theta."""
    shutil.copytree(SPECFORGE_DRAFTS / ("to_hf" if embed else "to_sglang"), root / name)
    config = json.loads((root / name / "config.json").read_text())
    if eagle_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle_ids, "use_aux_hidden_state": True}
    if rope_theta is not None:
        config["rope_theta"] = config["rope_parameters"]["rope_theta"] = rope_theta
    (root / name / "config.json").write_text(json.dumps(config))
    return root / name


def edit(src: Path, dst: Path, *, tensors: Callable[[dict], None] | None = None,
         config: Callable[[dict], None] | None = None) -> Path:
    """A copy of the export `src` with its tensors (name -> tensor) and config edited in place by the callables."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("speculators"))
    if tensors is not None:
        state = load_file(str(dst / "model.safetensors"))
        tensors(state)
        save_file({k: t.contiguous() for k, t in state.items()}, str(dst / "model.safetensors"))
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data))
    return dst


def _rename(old: str, new: str):
    return lambda s: s.__setitem__(new, s.pop(old))


def _transpose(name: str):
    return lambda s: s.__setitem__(name, s[name].t())


def _randomise(state: dict) -> None:
    import torch

    generator = torch.Generator().manual_seed(1)
    for name, t in state.items():
        if t.is_floating_point():
            state[name] = torch.randn(t.shape, generator=generator).to(t.dtype)


def _prefix_model(state: dict) -> None:
    for name in list(state):
        if not name.startswith("lm_head") and name not in ("d2t", "t2d"):
            state["model." + name] = state.pop(name)


def _identity_d2t(state: dict) -> None:
    """The identity mapping written out, as longrun's exporter did for a draft of the full vocabulary."""
    import torch

    state["d2t"] = torch.zeros(VERIFIER["vocab_size"], dtype=torch.long)
    state["t2d"] = torch.ones(VERIFIER["vocab_size"], dtype=torch.bool)


def _ids(top: list[int], eagle: list[int]):
    def change(c: dict) -> None:
        c["eagle_aux_hidden_state_layer_ids"] = top
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = eagle
    return change


def _vllm_v1_eagle_ids(version: str, moe: bool = False) -> bool:
    """vLLM's default runner reads eagle_config.eagle_aux_hidden_state_layer_ids (the V1 runner from 0.22.0) for a
    dense Llama verifier only in 0.22.0 (V2 serves listed architectures, Llama from 0.23.0, and from 0.25.0 any
    verifier that is not MoE); for an MoE verifier not listed, 0.22.0 to 0.28.0 (V2 everywhere from 0.29.0)."""
    return v("0.22.0") <= v(version) < (v("0.29.0") if moe else v("0.23.0"))


# draft -> (how it is made, {engine: verdict, or version -> verdict}); engines not named refuse it for its format
# (SGLang: speculators' format; speculators: the engine format)
Q, O_PROJ = "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.o_proj.weight"
DRAFTS: dict[str, tuple[Callable[[Path, dict], Path], dict]] = {
    # valid
    "longrun eagle3": (lambda r, b: b["eagle3"], {"vllm": PASS, "sglang": PASS}),
    "longrun eagle3 speculators": (lambda r, b: b["eagle3"] / "speculators", {"vllm": PASS, "speculators": PASS}),
    "longrun eagle3.1": (lambda r, b: b["eagle31"], {
        "vllm": lambda x: PASS if v(x) >= v("0.22.0") else REFUSE,
        "sglang": lambda x: PASS if v(x) >= v("0.5.12") else REFUSE}),
    "longrun eagle3.1 speculators": (lambda r, b: b["eagle31"] / "speculators", {
        "vllm": lambda x: PASS if v(x) >= v("0.25.0") else REFUSE, "speculators": PASS}),
    "longrun full vocab (no d2t)": (lambda r, b: b["full"], {"vllm": PASS, "sglang": PASS}),
    "SpecForge stock (to_sglang)": (lambda r, b: b["specforge"], {"vllm": PASS, "sglang": PASS}),
    "SpecForge stock (to_hf, embedding)": (lambda r, b: b["specforge_hf"], {"vllm": PASS, "sglang": PASS}),
    "SpecForge default ids in eagle_config": (lambda r, b: b["specforge_ids"], {
        # V1 reads eagle_config's ids from 0.22.0 as inputs of layers: one layer early; V2 takes the default
        "vllm": lambda x: REFUSE if _vllm_v1_eagle_ids(x) else PASS, "sglang": PASS}),
    "model.-prefixed names": (lambda r, b: edit(b["eagle3"], r / "prefixed", tensors=_prefix_model), {
        "vllm": REFUSE, "sglang": PASS}),
    "float d2t": (lambda r, b: edit(b["eagle3"], r / "float_d2t", tensors=lambda s: s.__setitem__(
        "d2t", s["d2t"].float())), {"vllm": PASS, "sglang": REFUSE}),
    "norm_before_residual true (engine)": (lambda r, b: edit(b["eagle3"], r / "nbr", config=lambda c: c.update(
        norm_before_residual=True)), {"vllm": REFUSE, "sglang": PASS}),
    "tie_word_embeddings true": (lambda r, b: edit(b["eagle3"], r / "tied", config=lambda c: c.update(
        tie_word_embeddings=True)), {"vllm": PASS, "sglang": REFUSE}),
    # one defect each
    "full vocab with d2t": (lambda r, b: edit(b["full"], r / "full_d2t", tensors=_identity_d2t), {
        "vllm": lambda x: REFUSE if v(x) >= v("0.30.0") else PASS, "sglang": PASS}),
    "SpecForge custom ids in eagle_config": (lambda r, b: b["specforge_custom"], {"vllm": REFUSE, "sglang": PASS}),
    "renamed q_proj": (lambda r, b: edit(b["eagle3"], r / "renamed", tensors=_rename(
        Q, "midlayer.self_attn.query.weight")), {"vllm": REFUSE, "sglang": REFUSE}),
    "missing down_proj": (lambda r, b: edit(b["eagle3"], r / "missing", tensors=lambda s: s.pop(
        "midlayer.mlp.down_proj.weight")), {"vllm": REFUSE, "sglang": REFUSE}),
    "missing lm_head": (lambda r, b: edit(b["eagle3"], r / "no_head", tensors=lambda s: s.pop("lm_head.weight")), {
        "vllm": REFUSE, "sglang": REFUSE}),
    "extra tensor": (lambda r, b: edit(b["eagle3"], r / "extra", tensors=lambda s: s.__setitem__(
        "midlayer.self_attn.q_norm.weight", s["norm.weight"][:8].clone())), {"vllm": REFUSE, "sglang": REFUSE}),
    "lm_head one row short": (lambda r, b: edit(b["eagle3"], r / "short", tensors=lambda s: s.__setitem__(
        "lm_head.weight", s["lm_head.weight"][:-1])), {"vllm": REFUSE, "sglang": REFUSE}),
    "missing d2t": (lambda r, b: edit(b["eagle3"], r / "no_d2t", tensors=lambda s: s.pop("d2t")), {
        "vllm": REFUSE, "sglang": REFUSE}),
    "no draft_vocab_size": (lambda r, b: edit(b["eagle3"], r / "no_dvs", config=lambda c: c.pop(
        "draft_vocab_size")), {"vllm": REFUSE, "sglang": REFUSE}),
    "vocab_size not the verifier's": (lambda r, b: edit(b["eagle3"], r / "vocab", config=lambda c: c.update(
        vocab_size=120)), {"vllm": REFUSE, "sglang": REFUSE}),
    "layer ids shifted": (lambda r, b: edit(b["eagle3"], r / "shifted", config=_ids([1, 3, 6], [0, 2, 5])), {
        "vllm": REFUSE, "sglang": REFUSE}),
    "layer ids out of range": (lambda r, b: edit(b["eagle3"], r / "range", config=_ids([2, 4, 9], [1, 3, 8])), {
        "vllm": REFUSE, "sglang": REFUSE}),
    "rope_theta not the verifier's": (lambda r, b: edit(b["eagle3"], r / "theta", config=lambda c: c.update(
        rope_theta=10000.0)), {"vllm": REFUSE, "sglang": REFUSE}),
    "rope_theta missing": (lambda r, b: edit(b["eagle3"], r / "no_theta", config=lambda c: c.pop("rope_theta")), {
        "vllm": REFUSE, "sglang": REFUSE}),
    "rope_scaling added": (lambda r, b: edit(b["eagle3"], r / "scaling", config=lambda c: c.update(
        rope_scaling={"rope_type": "linear", "factor": 2.0})), {"vllm": REFUSE, "sglang": REFUSE}),
    "SpecForge rope_theta not the verifier's": (lambda r, b: b["specforge_theta"], {"vllm": REFUSE, "sglang": REFUSE}),
    "speculators: no norm_before_residual": (lambda r, b: edit(b["eagle3"] / "speculators", r / "spec_nbr",
                                                               config=lambda c: c.pop("norm_before_residual")), {
        "vllm": REFUSE, "speculators": PASS}),
    "speculators: RoPE not the training config's": (lambda r, b: _speculators_theta(r, b), {
        "vllm": REFUSE, "speculators": REFUSE}),
    "speculators: no embed_tokens": (lambda r, b: edit(b["eagle3"] / "speculators", r / "spec_embed",
                                                       tensors=lambda s: s.pop("embed_tokens.weight")), {
        "vllm": PASS, "speculators": REFUSE}),
    # misreads no name or shape shows: refused by the smoke decode (tests/trainer/test_check_draft.py)
    "square o_proj transposed": (lambda r, b: edit(b["eagle3"], r / "transposed", tensors=_transpose(O_PROJ)), {
        "vllm": SMOKE, "sglang": SMOKE}),
    "random weights": (lambda r, b: edit(b["eagle3"], r / "random", tensors=_randomise), {
        "vllm": SMOKE, "sglang": SMOKE}),
}


def _speculators_theta(root: Path, built: dict) -> Path:
    """longrun's export pair with the speculators config's rope_theta changed: the engine export beside it is the
    training config."""
    pair = shutil.copytree(built["eagle3"], root / "spec_theta")
    data = json.loads((pair / "speculators" / "config.json").read_text())
    data["transformer_layer_config"]["rope_parameters"]["rope_theta"] = 10000.0
    (pair / "speculators" / "config.json").write_text(json.dumps(data))
    return pair / "speculators"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_matrix")
    (root / "verifier").mkdir()
    (root / "verifier" / "config.json").write_text(json.dumps(VERIFIER))
    built = {"eagle3": longrun_export(root, "eagle3"), "eagle31": longrun_export(root, "eagle31", eagle31=True),
             "full": longrun_export(root, "full", draft_vocab=VERIFIER["vocab_size"]),
             "specforge": specforge_export(root, "specforge"),
             "specforge_hf": specforge_export(root, "specforge_hf", embed=True),
             "specforge_ids": specforge_export(root, "specforge_ids", eagle_ids=[1, 3, 4]),
             "specforge_custom": specforge_export(root, "specforge_custom", eagle_ids=[2, 4, 5]),
             "specforge_theta": specforge_export(root, "specforge_theta", rope_theta=10000.0)}
    return {name: make(root, built) for name, (make, _) in DRAFTS.items()}


def expected(draft: str, engine: str, version: str) -> str:
    verdict = DRAFTS[draft][1].get(engine, REFUSE)
    return verdict(version) if callable(verdict) else verdict


def verdicts(matrix: dict[str, Path]) -> list[tuple[str, str, str, str, str, list[str]]]:
    """(draft, engine, version, expected, got, refusals) for every draft, engine and release read."""
    verifier = Verifier.from_config(VERIFIER)
    rows = []
    for draft, directory in matrix.items():
        for engine, releases in READ_RELEASES.items():
            for version in releases:
                ((reading, _),) = check(directory, (engine,), verifier, version)
                got = REFUSE if reading.refused else PASS
                rows.append((draft, engine, version, expected(draft, engine, version), got, reading.refused))
    return rows


def test_no_valid_draft_is_refused_and_no_refused_draft_passes(matrix):
    rows = verdicts(matrix)
    wrong = [(d, e, ver, want, refused) for d, e, ver, want, got, refused in rows
             if (want == SMOKE and got != PASS) or (want != SMOKE and want != got)]
    assert wrong == []
    counts = Counter((want, got) for _, _, _, want, got, _ in rows)
    # the summary in docs/check-draft.md
    assert len(matrix) == 33 and len(rows) == 33 * 17
    assert counts == {(PASS, PASS): 176, (REFUSE, REFUSE): 353, (SMOKE, PASS): 32}, counts


def test_each_refusal_names_the_engine_code_it_follows(matrix):
    for draft, engine, version, _, _, refused in verdicts(matrix):
        ((reading, _),) = check(matrix[draft], (engine,), Verifier.from_config(VERIFIER), version)
        assert len(reading.sources) == len(refused)
        assert all(s.startswith(f"{engine} {reading.rules.split()[1]} ") for s in reading.sources), reading.sources


@pytest.mark.parametrize(("draft", "engine", "version", "words"), [
    ("full vocab with d2t", "vllm", "0.30.0", "There is no module or parameter named 'draft_id_to_target_id'"),
    ("float d2t", "sglang", "0.5.23", "d2t is F32: SGLang adds it to arange() without a cast"),
    ("norm_before_residual true (engine)", "vllm", "0.34.0", "runs hidden_norm before the residual"),
    ("SpecForge default ids in eagle_config", "vllm", "0.22.0",
     "captures layers [1, 3, 4] (eagle_config.eagle_aux_hidden_state_layer_ids) but the draft was trained on "
     "[2, 4, 5]"),
    ("SpecForge custom ids in eagle_config", "vllm", "0.34.0",
     "captures layers [2, 4, 5] (the verifier's default (2, N/2, N-3)) but the draft was trained on [3, 5, 6]"),
    ("rope_theta missing", "sglang", "0.5.11", "RoPE as rope_theta 10000, no scaling; the verifier's is "
     "rope_theta 500000"),
    ("speculators: RoPE not the training config's", "speculators", "0.9.0", "(the training config)"),
    ("model.-prefixed names", "vllm", "0.21.0", "model.fc.weight is not a parameter"),
])
def test_a_refusal_gives_the_engines_reason(matrix, draft, engine, version, words):
    ((reading, _),) = check(matrix[draft], (engine,), Verifier.from_config(VERIFIER), version)
    assert any(words in r for r in reading.refused), reading.refused


def test_ids_only_in_eagle_config_for_an_moe_verifier_follow_vllms_runner(matrix):
    """An MoE verifier (Kimi-K2.5's family) is served by the V1 runner through 0.28.0, which reads eagle_config's
    ids as inputs of layers; without --verifier the runner is not known where the two runners disagree."""
    moe = Verifier.from_config({**VERIFIER, "architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 8})
    assert moe.moe and not Verifier.from_config(VERIFIER).moe
    for version in READ_RELEASES["vllm"]:
        ((reading, _),) = check(matrix["SpecForge default ids in eagle_config"], ("vllm",), moe, version)
        assert bool(reading.refused) == _vllm_v1_eagle_ids(version, moe=True), (version, reading.refused)
    ((reading, _),) = check(matrix["SpecForge default ids in eagle_config"], ("vllm",), None, "0.25.0")
    assert any("depends on the verifier's architecture: pass --verifier" in r for r in reading.refused)
    ((reading, _),) = check(matrix["SpecForge default ids in eagle_config"], ("vllm",), None, "0.30.0")
    assert reading.capture_default and "pass --verifier to compare them" in reading.refused[0]


def test_rope_is_checked_against_the_training_config_without_a_verifier(matrix, tmp_path):
    """longrun keeps the config it trained with in its checkpoints (checkpoints/step_N/config.json): an export whose
    RoPE was edited after training is refused without --verifier too; one as trained passes."""
    run = shutil.copytree(matrix["longrun eagle3"], tmp_path / "run", ignore=shutil.ignore_patterns("speculators"))
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    shutil.copy(run / "config.json", run / "checkpoints" / "step_00000010" / "config.json")
    for engine in ("vllm", "sglang"):
        assert check(run, (engine,))[0][0].refused == []
    config = json.loads((run / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 64}
    (run / "config.json").write_text(json.dumps(config))
    for engine in ("vllm", "sglang"):
        ((reading, _),) = check(run, (engine,))
        assert any("llama3 scaling factor 8.0" in r and "(the training config)" in r for r in reading.refused), \
            reading.refused


def test_a_verifier_scaling_longrun_does_not_train_with_is_not_held_against_its_export(matrix):
    """longrun trains a draft without a RoPE scaling of another type than linear, llama3 or yarn
    (trainer/model.py DraftConfig.from_verifier): its export is read as trained; another trainer's is compared."""
    dynamic = Verifier.from_config({**VERIFIER, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    ((reading, _),) = check(matrix["longrun eagle3"], ("vllm",), dynamic)
    assert reading.refused == []
    ((reading, _),) = check(matrix["SpecForge stock (to_sglang)"], ("vllm",), dynamic)
    assert any("the verifier's is rope_theta 500000, dynamic scaling factor 2.0" in r for r in reading.refused)


def test_stock_specforge_exports_pass_without_a_verifier_too(matrix):
    """Without --verifier the layer count is unknown, but the engine's default is the trained default."""
    for engine in ("vllm", "sglang"):
        ((reading, _),) = check(matrix["SpecForge stock (to_sglang)"], (engine,))
        assert reading.refused == [] and reading.capture_default
