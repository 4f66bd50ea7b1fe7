"""A speculators >= 0.5 dataset with hidden-states files missing, extra, of another hidden size, or with the 4 layer
ids speculators users hold: refused with the rows, files and shapes named, or taken and said how (the fixtures are
written by speculators 0.9.0's own data code, see peer_layouts)."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.trainer.conftest import one_cpu_thread
from tests.trainer.peer_layouts import write_speculators_arrow
from tests.trainer.tiny_setup import DRAFT_VOCAB, HIDDEN, LAYERS, VOCAB, build_dataset, build_verifier
from trainer.data import HiddenStatesDataset, list_samples
from trainer.formats import compact_ranges, open_training_data
from trainer.train import main as train_main
from trainer.train import parse_args

ROWS = 12


@pytest.fixture(scope="module")
def arrow(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gaps")
    with one_cpu_thread():
        verifier = build_verifier(root / "verifier")
        g = torch.Generator().manual_seed(0)
        samples = [(torch.randint(0, VOCAB, (12 + i,), generator=g), torch.ones(12 + i, dtype=torch.long))
                   for i in range(ROWS)]
        write_speculators_arrow(root / "verifier", verifier, samples, root / "data", DRAFT_VOCAB)
    return {"verifier": root / "verifier", "data": root / "data"}


def copy_of(root: Path, to: Path) -> Path:
    shutil.copytree(root, to)
    return to


def test_compact_ranges_join_runs():
    assert compact_ranges([9, 1, 7, 8]) == "1, 7-9"
    assert compact_ranges(range(0, 100, 2), limit=3) == "0, 2, 4 and 47 more"


def test_missing_hidden_states_files_are_refused_naming_the_rows_as_speculators_refuses_them(arrow, tmp_path):
    from speculators.train.data import ArrowDataset

    data = copy_of(arrow["data"], tmp_path / "data")
    for i in (1, 7, 8, 9):
        (data / "hidden_states" / f"hs_{i}.safetensors").unlink()
    with pytest.raises(RuntimeError, match="Failed to load hidden states for sample 1"):  # speculators' own reader
        for index in range(ROWS):
            ArrowDataset(64, data, on_missing="raise")._get_raw_data(index)
    for data_dir in (data, data / "hidden_states"):
        with pytest.raises(ValueError, match=r"8 hidden-states files for the 12 rows of .*data: no hs_\{i\}"
                                             r"\.safetensors for rows 1, 7-9 \(4 of 12; .*Failed to load hidden "
                                             r"states for sample 1"):
            open_training_data(data_dir, "auto", LAYERS, [2, 4, 5])


def test_files_past_the_arrow_rows_are_refused(arrow, tmp_path):
    data = copy_of(arrow["data"], tmp_path / "data")
    hs = data / "hidden_states"
    shutil.copy(hs / "hs_0.safetensors", hs / "hs_12.safetensors")
    shutil.copy(hs / "hs_0.safetensors", hs / "hs_13.safetensors")
    with pytest.raises(ValueError, match=r"14 hidden-states files for the 12 rows .*files past the last row 11: "
                                         r"hs_ 12-13"):
        open_training_data(data, "speculators", LAYERS, [2, 4, 5])


def test_a_file_of_another_hidden_size_is_named_with_its_shape_in_any_position(arrow, tmp_path):
    data = copy_of(arrow["data"], tmp_path / "data")
    path = data / "hidden_states" / "hs_2.safetensors"
    tensors = load_file(path)
    save_file({**tensors, "hidden_states": tensors["hidden_states"][..., : HIDDEN // 2].contiguous()}, str(path))
    rows = tensors["token_ids"].shape[0]
    for hidden_size in (None, HIDDEN):  # from the verifier's config, or else the first sample read
        opened = open_training_data(data, "auto", LAYERS, [2, 4, 5], hidden_size)
        dataset = opened.dataset(opened.files, 64)
        dataset.read_batch([0, 1])
        for batch in ([0, 2], [2]):
            with pytest.raises(ValueError, match=rf"hs_2\.safetensors: 'hidden_states' \[{rows}, 4, 32\] .*features "
                                                 r"96 and 32 wide, expected \[3 x 64 = 192\] and \[64\]"):
                dataset.read_batch(batch)
    with pytest.raises(ValueError, match=r"hs_2\.safetensors: .*the verifier's hidden_size 64"):
        open_training_data(data, "auto", LAYERS, [2, 4, 5], HIDDEN).dataset(opened.files, 64).read_batch([2])


def test_longruns_own_samples_of_another_hidden_size_are_named(tmp_path):
    with one_cpu_thread():
        verifier = build_verifier(tmp_path / "verifier")
        build_dataset(verifier, tmp_path / "data", samples=3, length=8)
    files = list_samples(tmp_path / "data")
    tensors = load_file(files[1])
    save_file({**tensors, "hidden_states": tensors["hidden_states"][:, :96].contiguous(),
               "last_hidden_state": tensors["last_hidden_state"][:, :32].contiguous()}, str(files[1]))
    dataset = HiddenStatesDataset(None, 64, files=files, hidden_size=HIDDEN)
    dataset.read_batch([0])
    with pytest.raises(ValueError, match=r"sample_000001\.safetensors: hidden_states \[8, 96\], last_hidden_state "
                                         r"\[8, 32\]: features 96 and 32 wide, expected \[3 x 64 = 192\]"):
        dataset.read_batch([1])


def test_speculators_four_layer_ids_are_taken_with_the_last_as_the_target(arrow, tmp_path):
    for given in (["--layer-ids", "2", "4", "5", "8"], ["--layer-ids", "2,4,5,8"], ["--layer-ids", "[2, 4, 5, 8]"]):
        args = parse_args(["--verifier-path", "V", "--data-dir", "D", "--vocab-mapping-dir", "M", "--output-dir", "O",
                           *given])
        assert args.data.layer_ids == [2, 4, 5, 8]
    opened = open_training_data(arrow["data"], "auto", LAYERS, [2, 4, 5, 8])
    assert opened.layer_ids == [2, 4, 5]
    assert opened.notes == ["layer ids 2 4 5 8 (--layer-ids): 8 is the verifier's last layer, used as the target; "
                            "capture layers 2 4 5"]
    with pytest.raises(ValueError, match=r"layer ids 2 4 5 7 \(--layer-ids\): 4 ids are speculators' form, whose last "
                                         r"is the verifier's last layer \(8 for this 8-layer verifier"):
        open_training_data(arrow["data"], "auto", LAYERS, [2, 4, 5, 7])
    # launch_vllm.py's ids recorded in the files' metadata, the last layer appended
    data = copy_of(arrow["data"], tmp_path / "data")
    for path in sorted((data / "hidden_states").iterdir()):
        save_file(load_file(path), str(path), metadata={"eagle_aux_hidden_state_layer_ids": "[2, 4, 5, 8]"})
    recorded = open_training_data(data, "auto", LAYERS)
    assert recorded.layer_ids == [2, 4, 5]
    assert recorded.notes == ["layer ids 2 4 5 8 (hs_0.safetensors's eagle_aux_hidden_state_layer_ids): 8 is the "
                              "verifier's last layer, used as the target; capture layers 2 4 5"]


def test_the_trainer_says_what_it_made_of_four_layer_ids_and_trains(arrow, tmp_path, capsys):
    with one_cpu_thread():
        code = train_main(["--verifier-path", str(arrow["verifier"]), "--data-dir", str(arrow["data"]),
                           "--vocab-mapping-dir", str(arrow["data"]), "--output-dir", str(tmp_path / "out"),
                           "--layer-ids", "2", "4", "5", "8", "--max-steps", "2", "--max-seq-len", "32",
                           "--num-workers", "0", "--val-ratio", "0", "--sim-depth", "0"])
    assert code == 0
    assert ("layer ids 2 4 5 8 (--layer-ids): 8 is the verifier's last layer, used as the target; capture layers "
            "2 4 5") in capsys.readouterr().out
