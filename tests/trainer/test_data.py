from pathlib import Path

import pytest
import torch

from trainer.data import (
    HiddenStatesDataset,
    ShardBatchSampler,
    list_samples,
    make_loader,
    split_files,
)


def test_list_samples_accepts_the_prepare_output_dir(prepared_data: Path) -> None:
    files = list_samples(prepared_data / "hidden_states")
    assert files and files == sorted(files) and list_samples(prepared_data) == files


def test_split_is_deterministic_disjoint_and_keeps_one_val_file(prepared_data: Path) -> None:
    files = list_samples(prepared_data)
    train, val = split_files(prepared_data / "hidden_states", 0.1, seed=3)
    assert (train, val) == split_files(list(reversed(files)), 0.1, seed=3)
    assert not set(train) & set(val) and sorted(train + val) == files
    assert len(val) == round(len(files) * 0.1)
    assert split_files(files, 0.1, seed=4) != (train, val)
    assert len(split_files(files[:2], 0.01, seed=0)[1]) == 1
    assert split_files(files, 0.0, seed=0) == (files, [])


def test_dataset_truncates_to_max_seq_len(prepared_data: Path) -> None:
    full = HiddenStatesDataset(prepared_data / "hidden_states", max_seq_len=4096)
    short = HiddenStatesDataset(prepared_data / "hidden_states", max_seq_len=10)
    assert len(full) == len(short) == len(list_samples(prepared_data))
    item, cut = full[0], short[0]
    assert set(item) == {"input_ids", "loss_mask", "hidden_states", "last_hidden_state", "verifier_top_ids"}
    assert cut["input_ids"].shape == (10,) and cut["hidden_states"].shape == (
        10,
        item["hidden_states"].shape[1],
    )
    for name, tensor in cut.items():
        assert torch.equal(tensor, item[name][:10]) and tensor.dtype == item[name].dtype


def test_dataset_without_samples_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="trainer.prepare"):
        HiddenStatesDataset(tmp_path, max_seq_len=8)


def padded(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The reference batch: each item right-padded with zeros to the longest, attention_mask 1 on its tokens."""
    longest = max(item["input_ids"].shape[0] for item in items)
    out = {name: torch.stack([torch.cat([t, t.new_zeros(longest - len(t), *t.shape[1:])]) for t in
                              (item[name] for item in items)]) for name in items[0]}
    out["attention_mask"] = torch.tensor([[1] * len(i["input_ids"]) + [0] * (longest - len(i["input_ids"])) for i in items])
    return out


class IndexDataset(torch.utils.data.Dataset):
    """Items shaped like HiddenStatesDataset's whose input_ids carry the item's index."""

    def read_batch(self, indices, pin=False):
        return padded([self[i] for i in indices])

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        length = 1 + index % 3
        return {
            "input_ids": torch.full((length,), index, dtype=torch.long),
            "loss_mask": torch.ones(length, dtype=torch.uint8),
            "hidden_states": torch.zeros(length, 6, dtype=torch.bfloat16),
            "last_hidden_state": torch.zeros(length, 2, dtype=torch.bfloat16),
        }


def test_two_ranks_cover_the_data_exactly_once_in_step() -> None:
    dataset = IndexDataset(23)
    for epoch in (0, 1):
        loaders = [make_loader(dataset, 4, 0, True, 7, rank, 2, epoch) for rank in (0, 1)]
        assert len(loaders[0]) == len(loaders[1]) == 3
        seen = [
            int(batch["input_ids"][row, 0])
            for loader in loaders
            for batch in loader
            for row in range(len(batch["input_ids"]))
        ]
        assert sorted(seen) == list(range(len(dataset)))
    orders = [list(make_loader(dataset, 4, 0, True, 7, 0, 2, epoch).batch_sampler) for epoch in (0, 1)]
    assert orders[0] != orders[1]


def test_batch_sampler_resume_and_epochs() -> None:
    sampler = ShardBatchSampler(10, 2, shuffle=True, seed=1, rank=1, world_size=2)
    batches = list(sampler)
    sampler.set_epoch(0, start_batch=2)
    assert list(sampler) == batches[2:] and len(sampler) == len(batches) - 2
    sampler.set_epoch(1)
    assert list(sampler) != batches and len(sampler) == len(batches)
    # Batch size 1 with an odd count: the short rank repeats a sample so both take 3 steps.
    assert [len(list(ShardBatchSampler(5, 1, rank=r, world_size=2))) for r in (0, 1)] == [3, 3]
    strict = [list(ShardBatchSampler(5, 1, rank=r, world_size=2, even_batches=False)) for r in (0, 1)]
    assert sorted(i for batches in strict for batch in batches for i in batch) == list(range(5))


def test_reader_threads_give_the_batches_in_the_sampler_order(prepared_data: Path) -> None:
    dataset = HiddenStatesDataset(prepared_data, max_seq_len=16)
    inline = make_loader(dataset, 3, num_workers=0, shuffle=True, seed=5)
    threaded = make_loader(dataset, 3, num_workers=3, shuffle=True, seed=5)
    assert threaded.read_ahead == 12
    for epoch in (0, 1):
        for loader in (inline, threaded):
            loader.batch_sampler.set_epoch(epoch)
        pairs = list(zip(inline, threaded, strict=True))
        assert sum(b["input_ids"].shape[0] for b, _ in pairs) == len(dataset)
        assert all(torch.equal(a[k], b[k]) for a, b in pairs for k in a)


def test_a_loader_left_early_can_be_read_again(prepared_data: Path) -> None:
    dataset = HiddenStatesDataset(prepared_data, max_seq_len=16)
    loader = make_loader(dataset, 1, num_workers=2, shuffle=False)
    first = next(iter(loader))  # the epoch is abandoned with reads in flight
    again = list(loader)
    assert len(again) == len(dataset) and torch.equal(again[0]["input_ids"], first["input_ids"])


def test_batches_read_straight_from_disk_equal_safetensors_own_reader(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    files = []
    for i, length in enumerate((5, 12, 9, 7)):  # cut to 10: the longer are cut, the shorter padded
        sample = {"input_ids": torch.randint(0, 500, (length,)), "loss_mask": torch.randint(0, 2, (length,), dtype=torch.uint8),
                  "hidden_states": torch.randn(length, 24).to(torch.bfloat16), "last_hidden_state": torch.randn(length, 8).to(torch.bfloat16)}
        files.append(tmp_path / f"sample_{i:06d}.safetensors")
        save_file(sample, str(files[-1]), metadata={"source": "test"})
    dataset = HiddenStatesDataset(tmp_path, max_seq_len=10)
    expected = padded([{k: v[:10] for k, v in load_file(str(f)).items()} for f in files])
    assert expected["attention_mask"].sum(1).tolist() == [5, 10, 9, 7]
    direct = dataset.read_batch(range(4))
    (from_thread,) = list(make_loader(dataset, 4, num_workers=1, shuffle=False))
    for batch in (direct, from_thread):
        assert batch.keys() == expected.keys()
        for name, tensor in expected.items():
            assert batch[name].dtype == tensor.dtype and torch.equal(batch[name], tensor), name
    assert torch.equal(dataset[2]["hidden_states"], load_file(str(files[2]))["hidden_states"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_batches_are_read_into_pinned_memory(prepared_data: Path) -> None:
    # the GPU copies a batch straight from where the read put it, asynchronously
    loader = make_loader(HiddenStatesDataset(prepared_data, max_seq_len=16), 2, num_workers=2)
    batch = next(iter(loader))
    assert all(tensor.is_pinned() for tensor in batch.values())
