"""The trainer reads speculators' (0.3-0.4 and >= 0.5, bf16 and FP8) and SpecForge's offline data (written as their
code writes it, see peer_layouts) into the same batches, features and targets as its own layout, and trains on them
with the seed's flags."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from server.schemas import RunCreate
from tests.trainer.peer_layouts import write_specforge, write_speculators, write_speculators_arrow
from tests.trainer.test_train import read_metrics
from tests.trainer.tiny_setup import DRAFT_VOCAB, LAYERS, build_dataset, build_verifier
from trainer.data import HiddenStatesDataset, batch_to, list_samples
from trainer.formats import detect_format, open_training_data
from trainer.model import read_draft_config
from trainer.train import parse_args
from trainer.verifier_model import load_verifier_head
from trainer.vocab import load_vocab_mapping
from worker.jobs import trainer_flags

SAMPLES = 8
SEED_FLAGS = ["--epochs", "5", "--lr", "3e-5", "--max-seq-len", "4096", "--num-workers", "4", "--ttt-steps", "5",
              "--noise-std", "0.05", "--scheduler", "cosine", "--warmup-ratio", "0.01", "--val-ratio", "0.05"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """The same token sequences through the same verifier, in longrun's, speculators' and SpecForge's layouts."""
    root = tmp_path_factory.mktemp("layouts")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    verifier = build_verifier(root / "verifier")
    build_dataset(verifier, root / "longrun", samples=SAMPLES, length=32)
    files = list_samples(root / "longrun" / "hidden_states")
    samples = [(s["input_ids"], s["loss_mask"]) for s in (HiddenStatesDataset(None, 64, files=files)[i] for i in range(SAMPLES))]
    d2t, t2d = load_vocab_mapping(root / "longrun" / "vocab_mapping")
    # outputs of layers 1, 3, 4 = inputs of 2, 4, 5, the layers longrun's default captures; then the last layer
    speculators = write_speculators(verifier, samples, root / "speculators", [1, 3, 4, LAYERS - 1], DRAFT_VOCAB)
    speculators_default = write_speculators(verifier, samples[:2], root / "speculators_default", None, DRAFT_VOCAB)
    specforge = write_specforge(verifier, samples, root / "specforge", compress=False, d2t=d2t, t2d=t2d)
    specforge_gz = write_specforge(verifier, samples[:2], root / "specforge_gz", compress=True, d2t=d2t, t2d=t2d)
    arrow = write_speculators_arrow(root / "verifier", verifier, samples, root / "speculators_arrow", DRAFT_VOCAB)
    arrow_fp8 = write_speculators_arrow(root / "verifier", verifier, samples, root / "speculators_arrow_fp8",
                                        DRAFT_VOCAB, fp8=True)
    torch.set_num_threads(threads)
    return {
        "verifier": root / "verifier",
        "longrun": {"data": root / "longrun" / "hidden_states", "vocab": root / "longrun" / "vocab_mapping"},
        "speculators": speculators, "speculators_default": speculators_default,
        "specforge": specforge, "specforge_gz": specforge_gz,
        # speculators >= 0.5: --data-dir and the vocab maps are the Arrow dataset's directory
        "speculators_arrow": {"data": arrow, "vocab": arrow}, "speculators_arrow_fp8": {"data": arrow_fp8, "vocab": arrow_fp8},
    }


ARROW_LAYER_IDS = [2, 4, 5]  # vLLM's default for 8 layers: inputs of 2, N//2, N-3 (and N, the last)


@pytest.mark.parametrize("layout", ["speculators", "specforge", "specforge_gz", "speculators_arrow",
                                    "speculators_arrow_fp8"])
def test_peer_layouts_give_longrun_batches_features_and_targets(layouts, layout):
    arrow = layout.startswith("speculators_arrow")
    data = open_training_data(layouts[layout]["data"], "auto", LAYERS, ARROW_LAYER_IDS if arrow else None)
    reference = open_training_data(layouts["longrun"]["data"], "longrun", LAYERS)
    assert data.format == layout.removesuffix("_gz").removesuffix("_fp8").removesuffix("_arrow")
    assert data.layer_ids == reference.layer_ids == [2, 4, 5]
    count = len(data.files)
    cpu = torch.device("cpu")
    stored = data.dataset(data.files, 24).read_batch(list(range(count)))
    assert stored["hidden_states"].dtype == (torch.float8_e4m3fn if layout.endswith("fp8") else torch.bfloat16)
    batch = batch_to(stored, cpu, torch.float32)
    expected = batch_to(reference.dataset(reference.files[:count], 24).read_batch(list(range(count))), cpu, torch.float32)
    for name in ("input_ids", "loss_mask", "attention_mask"):
        assert torch.equal(batch[name], expected[name]), name
    # FP8 e4m3 keeps 3 mantissa bits: 1/16 relative at worst
    tolerance = {"atol": 0.05, "rtol": 0.07} if layout.endswith("fp8") else {"atol": 0.03, "rtol": 0.02}
    for name in ("hidden_states", *(() if data.last_hidden_state_normed else ("last_hidden_state",))):
        torch.testing.assert_close(batch[name], expected[name], **tolerance)
    rows = [list(range(count))]  # --pack-samples: every sample in one row
    packed = data.dataset(data.files, 24).read_packed_batch(rows)
    expected_packed = reference.dataset(reference.files[:count], 24).read_packed_batch(rows)
    assert packed["documents"] == expected_packed["documents"]
    assert torch.equal(packed["position_ids"], expected_packed["position_ids"])
    assert torch.equal(packed["input_ids"], expected_packed["input_ids"])

    d2t, t2d = load_vocab_mapping(layouts[layout]["vocab"])
    head, _ = load_verifier_head(layouts["verifier"], d2t, t2d)
    head.input_is_normed = data.last_hidden_state_normed
    reference_head, _ = load_verifier_head(layouts["verifier"], d2t, t2d)
    targets = head.logits(batch["last_hidden_state"]).argmax(-1)
    expected_targets = reference_head.logits(expected["last_hidden_state"]).argmax(-1)
    assert (targets == expected_targets).float().mean() > 0.97  # bf16 storage may flip a near tie


def test_speculators_arrow_data_is_read_as_speculators_own_reader_reads_it(layouts):
    """speculators 0.9.0's ArrowDataset (with hs_connectors' FP8Transfer for FP8) gives the same features."""
    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset

    for layout, transfer in (("speculators_arrow", FileTransfer), ("speculators_arrow_fp8", FP8Transfer)):
        root = layouts[layout]["data"]
        theirs = ArrowDataset(64, root, transfer=transfer(root / "hidden_states"), on_missing="raise")[1]
        data = open_training_data(root, "speculators", LAYERS, ARROW_LAYER_IDS)
        ours = batch_to(data.dataset(data.files, 64).read_batch([1]), torch.device("cpu"), torch.bfloat16)
        assert torch.equal(ours["input_ids"][0], theirs["input_ids"])
        assert torch.equal(ours["loss_mask"][0].long(), theirs["loss_mask"].long())
        assert torch.equal(ours["hidden_states"][0], theirs["hidden_states"].to(torch.bfloat16)), layout
        assert torch.equal(ours["last_hidden_state"][0], theirs["verifier_last_hidden_states"].to(torch.bfloat16))


def test_speculators_arrow_layer_ids_come_from_the_flag_or_the_files_never_shifted(layouts, tmp_path):
    root = layouts["speculators_arrow"]["data"]
    for data_dir in (root, root / "hidden_states"):  # the dataset's directory or its hidden_states
        with pytest.raises(ValueError, match=r"hs_0\.safetensors has no 'eagle_aux_hidden_state_layer_ids' metadata"
                                             r".*--layer-ids.*default for this 8-layer verifier is 2,4,5"):
            open_training_data(data_dir, "auto", LAYERS)
        assert open_training_data(data_dir, "speculators", LAYERS, [1, 3, 6]).layer_ids == [1, 3, 6]
    copy = tmp_path / "arrow"
    (copy / "hidden_states").mkdir(parents=True)
    for name in ("state.json", "dataset_info.json", "data-00000-of-00001.arrow"):
        (copy / name).write_bytes((root / name).read_bytes())
    for path in sorted((root / "hidden_states").iterdir()):
        save_file(load_file(path), str(copy / "hidden_states" / path.name),
                  metadata={"eagle_aux_hidden_state_layer_ids": "[2, 4, 5, 8]"})
    assert open_training_data(copy, "auto", LAYERS).layer_ids == [2, 4, 5]  # vLLM's ids as they are: no +1


def test_speculators_arrow_errors_name_the_file_the_key_and_the_formats_tried(layouts, tmp_path):
    root = layouts["speculators_arrow_fp8"]["data"]
    copy = tmp_path / "arrow"
    (copy / "hidden_states").mkdir(parents=True)
    for name in ("state.json", "dataset_info.json", "data-00000-of-00001.arrow"):
        (copy / name).write_bytes((root / name).read_bytes())
    for path in (root / "hidden_states").iterdir():  # a file for every row (a missing one is refused up front)
        (copy / "hidden_states" / path.name).write_bytes(path.read_bytes())
    tensors = load_file(root / "hidden_states" / "hs_0.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "hidden_states_scales"}, str(copy / "hidden_states" / "hs_0.safetensors"))
    save_file({"hidden_states": tensors["hidden_states"]}, str(copy / "hidden_states" / "hs_1.safetensors"))
    swapped = load_file(root / "hidden_states" / "hs_2.safetensors")
    save_file({**swapped, "token_ids": tensors["token_ids"]}, str(copy / "hidden_states" / "hs_2.safetensors"))
    dataset = open_training_data(copy, "auto", LAYERS, ARROW_LAYER_IDS).dataset(
        open_training_data(copy, "auto", LAYERS, ARROW_LAYER_IDS).files, 24)
    with pytest.raises(KeyError, match=r"hs_0\.safetensors has float8 'hidden_states' and no 'hidden_states_scales'"):
        dataset[0]
    with pytest.raises(KeyError, match=r"hs_1\.safetensors lacks \['token_ids'\]: not a speculators >= 0\.5 "
                                       r"hidden-states file; formats tried: longrun .*SpecForge"):
        dataset[1]
    with pytest.raises(ValueError, match=r"hs_2\.safetensors: 'token_ids' differ from 'input_ids' of row 2"):
        dataset[2]
    (copy / "state.json").write_text("{}")
    with pytest.raises(ValueError, match=r"state\.json: no '_data_files'.*formats tried"):
        open_training_data(copy, "speculators", LAYERS, ARROW_LAYER_IDS)
    # a format forced on a directory without it names what it holds, or every format tried (this raised itself)
    with pytest.raises(FileNotFoundError, match=r"no specforge samples .*holds speculators data"):
        open_training_data(root, "specforge", LAYERS)
    (tmp_path / "empty").mkdir()
    for forced in ("longrun", "speculators", "specforge"):
        with pytest.raises(FileNotFoundError, match=r"empty \(formats tried: longrun \(sample_\*\.safetensors\); "
                                                    r"speculators >= 0\.5 .*speculators 0\.3-0\.4.*SpecForge"):
            open_training_data(tmp_path / "empty", forced, LAYERS)


def test_speculators_default_layers_are_outputs_so_inputs_shift_by_one(layouts):
    data = open_training_data(layouts["speculators_default"]["data"], "speculators", LAYERS)
    assert data.layer_ids == [3, LAYERS // 2 + 1, LAYERS - 2]  # outputs of 2, N//2, N-3


def test_vocab_maps_of_both_peers_are_read(layouts):
    sized = load_vocab_mapping(layouts["speculators_arrow"]["vocab"])  # d2t-192.npy, t2d-192.npy
    assert sized[0].shape == (DRAFT_VOCAB,) and int(sized[1].sum()) == DRAFT_VOCAB
    d2t, t2d = load_vocab_mapping(layouts["speculators"]["vocab"])
    assert d2t.shape == (DRAFT_VOCAB,) and t2d.dtype == torch.bool and int(t2d.sum()) == DRAFT_VOCAB
    target_ids = torch.arange(DRAFT_VOCAB) + d2t
    assert bool(t2d[target_ids].all())
    reference = load_vocab_mapping(layouts["longrun"]["vocab"])
    for got, want in zip(load_vocab_mapping(layouts["specforge"]["vocab"]), reference, strict=True):
        assert torch.equal(got, want)


def test_a_file_that_is_not_what_it_claims_is_named_with_its_missing_key(layouts, tmp_path):
    record = torch.load(sorted(layouts["speculators"]["data"].glob("data_*.pt"))[0], weights_only=True)
    del record["loss_mask"]
    (tmp_path / "spec").mkdir()
    torch.save(record, tmp_path / "spec" / "data_0.pt")
    data = open_training_data(tmp_path / "spec", "auto", LAYERS)
    with pytest.raises(KeyError, match=r"data_0\.pt has no 'loss_mask': not a speculators sample"):
        data.dataset(data.files, 16)[0]
    (tmp_path / "forge" / "rows_0-2000").mkdir(parents=True)
    torch.save({"input_ids": torch.arange(4)}, tmp_path / "forge" / "rows_0-2000" / "data_0.ckpt")
    data = open_training_data(tmp_path / "forge", "auto", LAYERS)
    with pytest.raises(KeyError, match="data_0.ckpt has no 'loss_mask': not a SpecForge sample"):
        data.dataset(data.files, 16)[0]
    with pytest.raises(FileNotFoundError, match="no specforge samples .* holds speculators data"):
        open_training_data(layouts["speculators"]["data"], "specforge", LAYERS)
    with pytest.raises(FileNotFoundError, match="data_\\*.pt"):
        detect_format(tmp_path / "nothing")


@pytest.mark.parametrize("layout", ["speculators", "speculators_arrow", "speculators_arrow_fp8"])
def test_speculators_data_trains_with_the_seed_flags_then_restarts_from_ttt_3_to_5(layouts, tmp_path, layout,
                                                                                   in_process):
    """In this process, through the trainer's own main (the served run below is the same data through torchrun)."""
    common = [*(str(a) for a in ("--verifier-path", layouts["verifier"], "--data-dir", layouts[layout]["data"],
                                 "--vocab-mapping-dir", layouts[layout]["vocab"], "--data-format", "speculators"))]
    if layout != "speculators":
        common += ["--layer-ids", "2,4,5"]
    assert in_process(["trainer.train", *common, "--output-dir", str(tmp_path / "ttt3"), *SEED_FLAGS[:8],
                       "--ttt-steps", "3", *SEED_FLAGS[10:]]) == 0
    assert in_process(["trainer.train", *common, "--output-dir", str(tmp_path / "ttt5"), *SEED_FLAGS,
                       "--init-from", str(tmp_path / "ttt3")]) == 0
    steps, validations = read_metrics(tmp_path / "ttt5")
    assert steps[-1]["step"] == steps[-1]["total_steps"] == 5 * (SAMPLES - 1)  # one sample held out, batch 1
    assert {"loss_4", "acc_4"} <= steps[-1].keys() and validations
    assert read_draft_config(tmp_path / "ttt5").aux_hidden_state_layer_ids == [2, 4, 5]
    config = json.loads((tmp_path / "ttt5" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # what vLLM captures


def test_the_documented_run_spec_validates_and_reaches_the_trainer_as_the_seed_command():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    section = readme[readme.index("## Bring your own data and model"):]
    start = section.index("```json") + len("```json")
    spec = RunCreate.model_validate(json.loads(section[start : section.index("```", start)]))
    args = parse_args(trainer_flags(spec.trainer)).flags()
    assert args["data_format"] == "speculators"
    seed = parse_args(["--verifier-path", "V", "--data-dir", "D", "--vocab-mapping-dir", "M", "--output-dir", "O",
                       *SEED_FLAGS]).flags()
    for name in ("epochs", "lr", "max_seq_len", "num_workers", "noise_std", "scheduler", "warmup_ratio", "val_ratio"):
        assert args[name] == seed[name], name


def test_speculators_data_through_the_service_with_the_seed_flags_restarts_from_ttt_3_to_5(layouts, service):
    """The seed's run as a user submits it: speculators' data and vocab mapping, the production flags unchanged
    (TTT=3 first), then a restart at TTT=5 into a cleaned output directory, with per-step metrics of both. On the
    team's layout (vLLM's Arrow rows and hs_*.safetensors, FP8): every layout trains 3 -> 5 in-process above, so
    one served run shows the service carries it (each served run is a server and two torchrun attempts)."""
    layout = "speculators_arrow_fp8"
    out = service.workspace / f"output_100k_{layout}"
    extra = {"layer_ids": "2,4,5"}
    trainer = {"verifier_path": str(layouts["verifier"]), "data_dir": str(layouts[layout]["data"]),
               "vocab_mapping_dir": str(layouts[layout]["vocab"]), "data_format": "speculators", **extra,
               "output_dir": str(out), "epochs": 5, "lr": 3e-5, "max_seq_len": 4096, "num_workers": 4,
               "ttt_steps": 3, "noise_std": 0.05, "scheduler": "cosine", "warmup_ratio": 0.01, "val_ratio": 0.05}
    run = service.submit({"name": "eagle3-seed", "host": "local", "nproc_per_node": 1, "trainer": trainer})
    first = service.wait_status(run["id"], "succeeded", "failed", timeout=300)
    assert first["status"] == "succeeded", service.logs(run["id"], tail=40)
    assert {"loss_2", "acc_2", "cond_acc_2"} <= set(first["latest"]) and "loss_3" not in first["latest"]
    restarted = service.client.post(f"/v1/runs/{run['id']}/restart", json={"overrides": {"ttt_steps": 5}, "clean": True})
    assert restarted.status_code == 202, restarted.text
    done = service.wait_status(run["id"], "succeeded", "failed", timeout=300)
    assert done["status"] == "succeeded" and done["attempt"] == 2, service.logs(run["id"], tail=40)
    steps = 5 * (SAMPLES - 1)  # one sample held out for validation, batch 1
    for k in range(5):
        series = service.series(run["id"], f"acc_{k}", attempt=2)
        assert [p["step"] for p in series] == list(range(1, steps + 1)), f"acc_{k} at every step of attempt 2"
    assert not service.series(run["id"], "acc_3", attempt=1), "attempt 1 trained three steps"
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
