"""The advisor with the serving engine in the cost: SGLang's sharded draft pays all-reduces and a logits all-gather
per draft forward, vLLM V0's replicated draft (draft_tensor_parallel_size 1) does not, and that moves the depth to
serve; vLLM V1 (the default) shards the draft at the target's tp whatever draft_tp says."""

from dataclasses import replace

import pytest

from server.advisor import CostModel, Drafting, advise

# every position accepted with probability 0.7 given the ones before: P(1..i accepted) = 0.7^i
CHAIN = {"position_acceptance": [0.7 ** i for i in range(1, 7)], "by_depth": []}
# tp=2, one verifier layer with one all-reduce, and every all-reduce call 250 µs whatever its size
COST = CostModel(tp=2, draft_step_ms=1.0, verifier_base_ms=10.0, verifier_per_token_ms=0.0,
                 allreduce_us=((1024, 250.0),), layers=1, hidden=8, allreduces_per_layer=1)


def test_sglang_and_vllm_serve_different_depths_because_of_the_drafts_all_reduces() -> None:
    # by hand: the verifier's round is 10 ms + one 0.25 ms all-reduce = 10.25 ms at every depth.
    # vllm V0 (replicated): + d x 1.0 ms of draft.  sglang (sharded at tp=2): + d x (1.0/2 + 3 all-reduces x 0.25
    # + 1 logits all-gather x 0.125, half an all-reduce) = 1.375 ms.
    # tau(d) = 1 + 0.7 + ... + 0.7^d = 1.7, 2.19, 2.533, 2.7731, 2.94117, 3.058819
    # vllm tokens/s: 1000 tau / (10.25 + d)     = 151.1, 178.8, 191.2, 194.6, 192.9, 188.2  -> depth 4
    # sglang:        1000 tau / (10.25 + 1.375d) = 146.2, 168.5, 176.21, 176.07, 171.7, 165.3 -> depth 3
    vllm = advise(CHAIN, "pcie", 2, COST, drafting=Drafting(engine="vllm", draft_tp=1, engine_version="0.7.3"))
    sglang = advise(CHAIN, "pcie", 2, COST, drafting=Drafting(engine="sglang"))
    assert vllm.recommended_depth == 4 and sglang.recommended_depth == 3
    assert [r.round_ms for r in vllm.by_depth] == pytest.approx([11.25, 12.25, 13.25, 14.25, 15.25, 16.25])
    assert [r.round_ms for r in sglang.by_depth] == pytest.approx([11.625, 13.0, 14.375, 15.75, 17.125, 18.5])
    assert vllm.tokens_per_second == pytest.approx(2773.1 / 14.25)
    assert sglang.tokens_per_second == pytest.approx(2533.0 / 14.375)
    assert vllm.no_speculation.round_ms == sglang.no_speculation.round_ms == pytest.approx(10.25)

    # the terms add up to the round, and say what was paid
    t = sglang.by_depth[2].terms
    assert (t.verifier_ms, t.verifier_allreduces, t.verifier_allreduce_ms) == pytest.approx((10.0, 1, 0.25))
    assert (t.draft_forwards, t.draft_compute_ms, t.draft_allreduces, t.draft_allreduce_ms) == pytest.approx(
        (3, 1.5, 12, 3 * 0.875))
    assert t.verifier_ms + t.verifier_allreduce_ms + t.draft_compute_ms + t.draft_allreduce_ms == pytest.approx(
        t.round_ms)
    assert vllm.by_depth[2].terms.draft_allreduces == 0 and vllm.by_depth[2].terms.draft_compute_ms == 3.0
    assert sglang.drafting.sharded and not vllm.drafting.sharded
    assert "sharded at tp=2" in sglang.drafting.description
    assert "logits_processor.py" in sglang.drafting.placement and "@009db01a7c0d" in sglang.drafting.placement
    assert "smaller_tp_proposer_worker.py" in vllm.drafting.placement


def test_vllm_v1_shards_the_draft_at_the_targets_tp_whatever_draft_tp_says_and_cites_the_code() -> None:
    sglang = advise(CHAIN, "pcie", 2, COST, drafting=Drafting(engine="sglang"))
    for drafting in (Drafting(engine="vllm"), Drafting(engine="vllm", draft_tp=1),
                     Drafting(engine="vllm", draft_tp=1, engine_version="0.11.0"),
                     Drafting(engine="vllm", draft_tp=2, engine_version="v0")):
        own = advise(CHAIN, "pcie", 2, COST, drafting=drafting)
        # vLLM V1 is priced as SGLang shards it, less the fc SGLang replicates (read whole once a round)
        assert [r.round_ms for r in own.by_depth] == pytest.approx([r.round_ms for r in sglang.by_depth], rel=1e-6), drafting
        assert own.drafting.sharded
    v1 = advise(CHAIN, "pcie", 2, COST, drafting=Drafting(engine="vllm", draft_tp=1)).drafting
    assert "vllm/v1/spec_decode/eagle.py" in v1.placement and "@f7eef1b6987f" in v1.placement
    assert "#17499" in v1.placement and "draft_tp=1 is not honoured" in v1.placement
    assert v1.description.startswith("vllm V1")
    with pytest.raises(ValueError, match="engine_version"):
        Drafting(engine="vllm", engine_version="latest")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 1 or the target's tp"):
        advise(CHAIN, "pcie", 2, COST, drafting=Drafting(engine="vllm", draft_tp=4))
    with pytest.raises(ValueError, match="draft_tp is vLLM's"):
        Drafting(engine="sglang", draft_tp=1)


def test_a_tree_verifies_topk_tokens_per_step_and_a_measured_round_is_taken_as_given() -> None:
    cost = CostModel(tp=2, draft_step_ms=1.0, verifier_base_ms=10.0, verifier_per_token_ms=0.5,
                     allreduce_us=((1024, 250.0),), layers=1, hidden=8, allreduces_per_layer=1)
    tree = advise(CHAIN, "pcie", 2, cost, drafting=Drafting(engine="sglang", topk=4))
    t = tree.by_depth[1].terms  # depth 2: 4 x 2 + 1 = 9 verified tokens, 10 + 0.5 x 9 = 14.5 ms
    assert (t.verified_tokens, t.verifier_ms) == (9, pytest.approx(14.5))
    # extend forward + one decode forward, each 3 all-reduces of 0.25 ms and one logits all-gather of 0.125 ms
    assert (t.draft_allreduces, t.draft_allreduce_ms) == (8, pytest.approx(1.75))

    measured = advise(CHAIN, "nvlink", 2, cost, drafting=Drafting(engine="measured",
                                                                   round_ms={0: 10.0, 1: 11.0, 2: 20.0}))
    assert [r.depth for r in measured.by_depth] == [1, 2]
    assert measured.recommended_depth == 1 and measured.tokens_per_second == pytest.approx(1700 / 11.0)
    with pytest.raises(ValueError, match="needs round_ms"):
        Drafting(engine="measured")


def test_a_trees_acceptance_is_the_chains_a_lower_bound_the_answer_states() -> None:
    # sim_acc_k and evaluate measure greedy top-1 chains only: a top-k tree's acceptance is not modelled
    cost = replace(COST, verifier_per_token_ms=0.5)
    chain = advise(CHAIN, "pcie", 2, cost, drafting=Drafting(engine="sglang"))
    tree = advise(CHAIN, "pcie", 2, cost, drafting=Drafting(engine="sglang", topk=4))
    assert [r.mean_accepted for r in tree.by_depth] == [r.mean_accepted for r in chain.by_depth]
    # so a tree pays for its extra verified tokens and gains nothing here: never faster than the chain
    assert all(t.round_ms > c.round_ms and t.tokens_per_second < c.tokens_per_second
               for t, c in zip(tree.by_depth, chain.by_depth, strict=True))
    assert tree.tokens_per_second <= chain.tokens_per_second
    assert not chain.drafting.acceptance_is_lower_bound and chain.drafting.acceptance.startswith("the chain's")
    assert tree.drafting.acceptance_is_lower_bound
    assert "top-4 tree, not modelled" in tree.drafting.acceptance and "lower bound" in tree.drafting.acceptance
    assert "acceptance: the chain's, a lower bound" in tree.drafting.description
    assert "top-4 tree's acceptance taken as the chain's, a lower bound" in tree.retrain.reason
    assert "lower bound" not in chain.retrain.reason
    # a measured tree round is still judged on the chain's acceptance, and says so
    timed = advise(CHAIN, "pcie", 2, cost, drafting=Drafting(engine="measured", topk=4, round_ms={0: 10.0, 1: 12.0}))
    assert timed.drafting.acceptance_is_lower_bound
