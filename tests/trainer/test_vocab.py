import pytest
import torch

from trainer.vocab import (
    VOCAB_MAPPING_FILE,
    build_vocab_mapping,
    draft_to_target_ids,
    load_vocab_mapping,
    save_vocab_mapping,
    target_to_draft_ids,
)


def test_most_frequent_tokens_with_ties_broken_by_id_sorted_by_target_id() -> None:
    counts = {9: 5, 3: 5, 7: 10, 1: 1, 4: 5}
    d2t, t2d = build_vocab_mapping(counts, vocab_size=12, draft_vocab_size=3)
    assert draft_to_target_ids(d2t).tolist() == [3, 4, 7]
    assert t2d.nonzero().flatten().tolist() == [3, 4, 7]


def test_offset_convention_target_id_is_draft_id_plus_d2t() -> None:
    d2t, t2d = build_vocab_mapping([2, 2, 5, 5, 5, 11, 11], vocab_size=16, draft_vocab_size=3)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [2 - 0, 5 - 1, 11 - 2]
    assert [draft_id + int(d2t[draft_id]) for draft_id in range(3)] == [2, 5, 11]
    to_draft = target_to_draft_ids(t2d)
    assert to_draft.shape == (16,) and to_draft.dtype == torch.int64
    assert to_draft[[2, 5, 11]].tolist() == [0, 1, 2]
    assert (to_draft[~t2d] == -1).all()
    assert torch.equal(to_draft[draft_to_target_ids(d2t)], torch.arange(3))


def test_draft_vocab_is_exactly_k_when_fewer_tokens_were_seen() -> None:
    d2t, t2d = build_vocab_mapping([6, 6, 9], vocab_size=10, draft_vocab_size=5)
    assert d2t.numel() == 5 and int(t2d.sum()) == 5
    # The two seen ids plus the smallest unseen ones.
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 6, 9]


def test_counts_mapping_and_id_stream_agree() -> None:
    ids = torch.randint(0, 50, (500,), generator=torch.Generator().manual_seed(0))
    counts = {int(i): int(c) for i, c in zip(*ids.unique(return_counts=True), strict=True)}
    assert all(
        torch.equal(a, b)
        for a, b in zip(build_vocab_mapping(ids, 50, 20), build_vocab_mapping(counts, 50, 20), strict=True)
    )


def test_save_load_round_trip(tmp_path) -> None:
    d2t, t2d = build_vocab_mapping({1: 3, 40: 2, 7: 9}, vocab_size=64, draft_vocab_size=8)
    save_vocab_mapping(tmp_path / "vocab_mapping", d2t, t2d)
    assert (tmp_path / "vocab_mapping" / VOCAB_MAPPING_FILE).is_file()
    loaded_d2t, loaded_t2d = load_vocab_mapping(tmp_path / "vocab_mapping")
    assert torch.equal(loaded_d2t, d2t) and torch.equal(loaded_t2d, t2d)
    assert loaded_d2t.dtype == torch.int64 and loaded_t2d.dtype == torch.bool


def test_bad_arguments_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping([1], vocab_size=4, draft_vocab_size=5)
    with pytest.raises(ValueError, match="token ids"):
        build_vocab_mapping([4], vocab_size=4, draft_vocab_size=2)
    with pytest.raises(FileNotFoundError, match="trainer.prepare"):
        load_vocab_mapping(tmp_path)
