import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from longrun.cli import main
from server.advisor import (
    INTERCONNECTS,
    NVLINK_ALLREDUCE_US,
    PCIE_P2P_DISABLED_ALLREDUCE_US,
    CostModel,
    advise,
    compare_interconnects,
    improved_positions,
    pcie_allreduce_us,
    pcie_extra_us_per_call,
)
from server.advisor.results import Objective

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200x2"

# The hand-worked setup: tp 2, 2 layers of hidden 4 (bf16: 8 bytes per token), two all-reduces per layer,
# an all-reduce table of 10 µs at 8 bytes and 30 µs at 24 bytes (1.25 µs per byte in between and beyond).
HAND = dict(
    tp=2, draft_step_ms=0.5, verifier_base_ms=3.0, verifier_per_token_ms=0.25,
    allreduce_us=((8, 10.0), (24, 30.0)), layers=2, hidden=4,
)
HAND_EVALUATION = {
    "by_depth": [{"depth": 1, "mean_accepted": 1.8}, {"depth": 2, "mean_accepted": 2.3},
                 {"depth": 3, "mean_accepted": 2.5}],
    "position_acceptance": [0.8, 0.5, 0.2],
}


def hand_cost() -> CostModel:
    return CostModel(**HAND)


def test_hand_worked_example():
    # depth 0: 1 token, 8 B -> 10 µs; comm 2 layers * 2 calls * 10 µs = 0.04 ms; verifier 3 + 0.25*1 = 3.25
    #          round 3.29 ms, 1 token  -> 1000/3.29  = 303.9514 tokens/s
    # depth 1: 2 tokens, 16 B -> 10 + 8*1.25 = 20 µs; comm 4*20 µs = 0.08 ms; verifier 3.5; draft 0.5
    #          round 4.08 ms, tau 1.8  -> 1800/4.08  = 441.1765 tokens/s
    # depth 2: 3 tokens, 24 B -> 30 µs; comm 0.12 ms; verifier 3.75; draft 1.0
    #          round 4.87 ms, tau 2.3  -> 2300/4.87  = 472.2793 tokens/s   <- best
    # depth 3: 4 tokens, 32 B -> 30 + 8*1.25 = 40 µs beyond the table; comm 0.16 ms; verifier 4.0; draft 1.5
    #          round 5.66 ms, tau 2.5  -> 2500/5.66  = 441.6961 tokens/s
    # speed-up over no speculation: (2300/4.87) / (1000/3.29) = 2.3*3.29/4.87 = 1.5538
    out = advise(HAND_EVALUATION, "nvlink", 2, hand_cost())
    assert [row.depth for row in out.by_depth] == [1, 2, 3]
    rounds = [row.round_ms for row in out.by_depth]
    speeds = [row.tokens_per_second for row in out.by_depth]
    assert out.no_speculation.round_ms == pytest.approx(3.29, abs=1e-9)
    assert out.no_speculation.tokens_per_second == pytest.approx(1000 / 3.29, abs=1e-9)
    assert rounds == pytest.approx([4.08, 4.87, 5.66], abs=1e-9)
    assert speeds == pytest.approx([1800 / 4.08, 2300 / 4.87, 2500 / 5.66], abs=1e-9)
    assert out.recommended_depth == 2
    assert out.tokens_per_second == pytest.approx(2300 / 4.87, abs=1e-9)
    assert out.speedup_vs_no_speculation == pytest.approx(2.3 * 3.29 / 4.87, abs=1e-9)
    assert [row.mean_accepted for row in out.by_depth] == [1.8, 2.3, 2.5]


def test_hand_worked_retrain_from_ttt_1_pays_off():
    # T = 1, so r = a_1 = 0.8: a_2 -> max(0.5, 0.8*0.8) = 0.64, a_3 -> max(0.2, 0.8**3) = 0.512.
    # tau_2 = 2.3 + 0.14 = 2.44, tau_3 = 2.5 + 0.14 + 0.312 = 2.952 (rounds unchanged: 4.87, 5.66 ms)
    # after: depth 2 -> 2440/4.87 = 501.03, depth 3 -> 2952/5.66 = 521.55 tokens/s  <- best, so TTT 3
    # gain over now (2300/4.87 = 472.28): 2952/5.66 / (2300/4.87) - 1 = 0.10433
    # break-even: 3000 GPU-s of training (1 GPU, nothing left to finish) against tp=2 serving GPUs saving
    # 2 x (4.87/2300 - 5.66/2952) ms-per-token each: 3000 / (2 x 0.00020005) = 7.498e6 tokens
    out = advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=1, retrain_seconds_by_ttt={1: 1000, 3: 3000})
    retrain = out.retrain
    assert retrain.trained_ttt == 1
    assert retrain.depth_after == 3 and retrain.suggested_ttt_steps == 3
    assert retrain.tokens_per_second_now == pytest.approx(2300 / 4.87, abs=1e-9)
    assert retrain.tokens_per_second_after == pytest.approx(2952 / 5.66, abs=1e-9)
    assert retrain.gain == pytest.approx((2952 / 5.66) / (2300 / 4.87) - 1, abs=1e-9)
    assert retrain.predicted_training_seconds == 3000
    assert retrain.break_even_tokens == pytest.approx(3000 / (2 * (4.87 / 2300 - 5.66 / 2952)), rel=1e-9)
    assert retrain.pays_off is True
    assert "depth 3" in retrain.reason and "3000 s" in retrain.reason
    assert f"won back after {retrain.break_even_tokens:.3g} tokens served" in retrain.reason
    assert "geometric-mean ratio" in retrain.assumption
    # the frontier: TTT=2 lifts position 2 only (0.64; position 3 keeps its 0.4 given 2: 0.256), serves at depth
    # 2 at 2440/4.87 tokens/s and trains 2000 s (the line through 1000 s and 3000 s); TTT=3 is the pick
    two, three = retrain.frontier
    assert (two.ttt, two.depth, three.ttt, three.depth) == (2, 2, 3, 3)
    assert two.tokens_per_second == pytest.approx(2440 / 4.87) and two.training_seconds == pytest.approx(2000)
    assert three.break_even_tokens == retrain.break_even_tokens and three.gpu_hours == pytest.approx(3000 / 3600)


def test_the_frontier_picks_by_the_deployments_serve_tokens_the_smallest_ttt_within_1_percent():
    # the same draft with TTT=3 dearer: 30000 s. Over 1e8 tokens served on tp=2, TTT=2 saves
    # 1e8 x 2 x (4.87/2300 - 4.87/2440) s = 2.4298e4 GPU-s less its 2000 s; TTT=3 saves 4.0010e4 less 30000
    evaluation, seconds = HAND_EVALUATION, {1: 1000, 2: 2000, 3: 30000}
    tokens_only = advise(evaluation, "nvlink", 2, hand_cost(), trained_ttt=1, retrain_seconds_by_ttt=seconds)
    assert tokens_only.retrain.suggested_ttt_steps == 3 and "training cost not weighed" in tokens_only.retrain.objective
    served = advise(evaluation, "nvlink", 2, hand_cost(), trained_ttt=1, retrain_seconds_by_ttt=seconds,
                    objective=Objective(serve_tokens=1e8))
    two, three = served.retrain.frontier
    assert two.net_gpu_hours == pytest.approx((1e8 * 2 * (4.87 / 2300 - 4.87 / 2440) - 2000) / 3600)
    assert three.net_gpu_hours == pytest.approx((1e8 * 2 * (4.87 / 2300 - 5.66 / 2952) - 30000) / 3600)
    assert served.retrain.suggested_ttt_steps == 2 and served.retrain.pays_off
    assert "net GPU-hours" in served.retrain.objective and "GPU-h over 1e+08 tokens served" in served.retrain.reason
    # too few tokens to win back any retrain: it says so and does not pay
    few = advise(evaluation, "nvlink", 2, hand_cost(), trained_ttt=1, retrain_seconds_by_ttt=seconds,
                 objective=Objective(serve_tokens=1e5)).retrain
    assert not few.pays_off and "no deeper TTT wins back its training within the 1e+05 tokens" in few.reason
    # GPU-hour prices: serving GPUs at 10 a GPU-hour against training ones at 1 make TTT=3 worth its 30000 s
    priced = advise(evaluation, "nvlink", 2, hand_cost(), trained_ttt=1, retrain_seconds_by_ttt=seconds,
                    objective=Objective(serve_tokens=1e8, train_gpu_hour_price=1.0, serve_gpu_hour_price=10.0)).retrain
    assert priced.suggested_ttt_steps == 3 and priced.frontier[1].net_value > priced.frontier[0].net_value


def test_hand_worked_retrain_from_ttt_2_does_not_move_the_depth():
    # T = 2: r = a_2/a_1 = 0.625, a_3 -> max(0.2, 0.5*0.625) = 0.3125, tau_3 = 2.6125.
    # depth 3 after: 2612.5/5.66 = 461.57 < depth 2's 472.28, so depth 2 (<= T) stays best: no retrain.
    retrain = advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=2).retrain
    assert retrain.depth_after == 2
    assert retrain.suggested_ttt_steps is None
    assert retrain.pays_off is False
    assert "would not speed up serving" in retrain.reason
    assert retrain.gain == pytest.approx(0.0, abs=1e-12)


def test_a_draft_already_accepting_beyond_its_trained_depth_has_nothing_to_lift_and_says_why():
    # conditional 0.8, 0.75 inside TTT=2 (r = 0.75), then 0.9 and 0.9: above the decay, so nothing improves
    positions = [0.8, 0.6, 0.54, 0.486]
    assert improved_positions(positions, 2) == positions
    out = advise({"position_acceptance": positions}, "pcie", 8, trained_ttt=2)
    retrain = out.retrain
    assert retrain.pays_off is False and retrain.suggested_ttt_steps is None and retrain.gain == 0.0
    assert retrain.depth_after == out.recommended_depth and retrain.tokens_per_second_after == out.tokens_per_second
    assert "gain nothing" in retrain.reason and "accepts 0.90 0.90 at positions 3..4" in retrain.reason
    assert "above the 0.750 per position" in retrain.reason


def test_pcie_model_fixture_is_the_advisors_pcie_table_at_tp_8():
    data = json.loads((FIXTURES.parent / "pcie-model" / "allreduce-pcie-tp8.json").read_text())
    assert data["world"] == 8 and len(data["gpus"]) == 8 and all("(PCIe model)" in g for g in data["gpus"])
    assert [row["bytes"] for row in data["allreduce"]] == [b for b, _ in pcie_allreduce_us(8)]
    assert [row["us"] for row in data["allreduce"]] == pytest.approx([us for _, us in pcie_allreduce_us(8)])


def test_small_gain_does_not_pay_off_but_names_the_depth():
    retrain = advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=1, min_gain=0.2).retrain
    assert retrain.suggested_ttt_steps == 3
    assert retrain.pays_off is False
    assert "below the 20%" in retrain.reason
    assert retrain.predicted_training_seconds is None and retrain.break_even_tokens is None


def test_retrain_without_known_training_time_still_pays_off():
    retrain = advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=1).retrain
    assert retrain.pays_off is True
    assert "training time unknown" in retrain.reason


def test_retrain_training_seconds_from_a_line_through_other_depths():
    retrain = advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=1,
                     retrain_seconds_by_ttt={1: 1000, 5: 3000}).retrain
    assert retrain.predicted_training_seconds == pytest.approx(2000)  # 1000 + (3-1) * 500
    assert "linear" in retrain.training_seconds_basis
    lone = advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=1, retrain_seconds_by_ttt={5: 3000})
    assert lone.retrain.predicted_training_seconds is None


def test_retrain_needs_a_known_trained_depth_and_a_deeper_evaluation():
    unknown = advise(HAND_EVALUATION, "nvlink", 2, hand_cost()).retrain
    assert unknown.pays_off is False and "trained_ttt" in unknown.reason
    shallow = advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=3).retrain
    assert shallow.pays_off is False and "evaluate deeper" in shallow.reason
    with pytest.raises(ValueError, match="trained_ttt"):
        advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), trained_ttt=0)


def test_improved_positions_follow_the_trained_decay():
    measured = [0.8, 0.6, 0.45, 0.1, 0.05, 0.01]
    better = improved_positions(measured, 3)
    ratio = (0.45 / 0.8) ** 0.5  # geometric mean of 0.6/0.8 and 0.45/0.6
    assert better[:3] == measured[:3]
    assert better[3:] == pytest.approx([0.45 * ratio, 0.45 * ratio**2, 0.45 * ratio**3])
    assert improved_positions([0.5, 0.4, 0.39], 1) == pytest.approx([0.5, 0.4, 0.39])  # measured already better
    assert improved_positions([0.5, 0.1, 0.0], 1) == pytest.approx([0.5, 0.25, 0.125])
    assert improved_positions([0.0, 0.0], 1) == [0.0, 0.0]
    assert improved_positions([0.7, 0.5], 2) == [0.7, 0.5]


def test_tau_falls_back_to_position_acceptance():
    only_positions = {"position_acceptance": [0.8, 0.5, 0.2]}
    out = advise(only_positions, "nvlink", 2, hand_cost())
    assert [row.mean_accepted for row in out.by_depth] == pytest.approx([1.8, 2.3, 2.5])
    partial = {"by_depth": [{"depth": 2, "mean_accepted": 2.2}], "position_acceptance": [0.8, 0.5, 0.2]}
    assert [row.mean_accepted for row in advise(partial, "nvlink", 2, hand_cost()).by_depth] == pytest.approx(
        [1.8, 2.2, 2.5]
    )


def test_no_depth_beats_plain_decoding_recommends_zero():
    out = advise({"position_acceptance": [0.01, 0.0]}, "pcie", 8)
    assert out.recommended_depth == 0
    assert out.speedup_vs_no_speculation == 1.0
    assert out.tokens_per_second == out.no_speculation.tokens_per_second


def test_the_drafts_round_cost_and_a_measured_one_token_forward_change_only_their_rounds():
    # hand: round(0) = 3.25 + 0.04 = 3.29 ms; round(1) = 0.5 + 3.5 + comm(16 B: 20 µs * 4 = 0.08) = 4.08 ms
    measured = CostModel(**{**HAND, "draft_round_ms": 0.2, "verifier_one_token_ms": 2.0})
    assert measured.round_ms(0) == pytest.approx(2.0 + 0.04), "no draft runs without speculation"
    assert measured.round_ms(1) == pytest.approx(hand_cost().round_ms(1) + 0.2)
    assert measured.round_ms(3) == pytest.approx(hand_cost().round_ms(3) + 0.2)
    out = advise(HAND_EVALUATION, "nvlink", 2, measured)
    assert out.no_speculation.tokens_per_second == pytest.approx(1000 / 2.04)
    with pytest.raises(ValueError, match="verifier_one_token_ms must be > 0"):
        CostModel(**{**HAND, "verifier_one_token_ms": 0.0})
    with pytest.raises(ValueError, match="draft_round_ms"):
        CostModel(**{**HAND, "draft_round_ms": -0.1})


def test_exact_ties_go_to_the_shallower_depth():
    # Flat cost (tp 1, free draft, no per-token cost): depths 1..3 all give tau 1.5 in the same 2 ms.
    flat = CostModel(tp=1, draft_step_ms=0, verifier_base_ms=2.0, verifier_per_token_ms=0, allreduce_us=((1, 1.0),))
    assert advise({"position_acceptance": [0.5, 0.0, 0.0]}, "nvlink", 1, flat).recommended_depth == 1


def linear_cost(fixed_ms: float, per_depth_ms: float) -> CostModel:
    # round_ms(d) = fixed_ms + per_depth_ms * d exactly (tp 1: no communication)
    return CostModel(tp=1, draft_step_ms=per_depth_ms, verifier_base_ms=fixed_ms, verifier_per_token_ms=0,
                     allreduce_us=((1, 1.0),))


def test_a_tie_under_the_cheaper_link_never_resolves_shallower_under_the_dearer_one():
    # Rounds cost 2 + d ms: tau 1.8 at depth 1 (3 ms) and 2.4 at depth 2 (4 ms) tie at 600 tokens/s
    # (no speculation: 1 token in 2 ms, 500 tokens/s).
    evaluation = {"position_acceptance": [0.8, 0.6]}
    assert advise(evaluation, "nvlink", 1, linear_cost(2.0, 1.0)).recommended_depth == 1
    # 1 ms more per round: 1.8/4 < 2.4/5, so depth 2.
    assert advise(evaluation, "pcie", 1, linear_cost(3.0, 1.0)).recommended_depth == 2
    # A per-round difference far below float rounding must not flip the tie either way.
    assert advise(evaluation, "pcie", 1, linear_cost(2.0 + 1e-15, 1.0)).recommended_depth == 1


def random_curve(rng: random.Random) -> list[float]:
    """A non-increasing acceptance curve; plateaus, zeros, ones and 3-decimal rounding make ties common."""
    a = [rng.choice([1.0, rng.random(), rng.random()])]
    for _ in range(rng.randint(0, 11)):
        roll = rng.random()
        a.append(a[-1] if roll < 0.2 else 0.0 if roll < 0.25 else a[-1] * rng.random() ** rng.uniform(0.05, 1.5))
    return [round(x, 3) for x in a] if rng.random() < 0.5 else a


def random_table(rng: random.Random) -> tuple[tuple[int, float], ...]:
    return tuple((4 ** k * 1024, rng.uniform(5, 400) * (1 + k) ** rng.uniform(0, 2)) for k in range(rng.randint(1, 9)))


def random_cost(rng: random.Random, table, tp: int, **fixed) -> CostModel:
    params = dict(
        draft_step_ms=rng.choice([0.0, rng.uniform(0, 3)]),
        verifier_base_ms=rng.uniform(0.5, 60),
        verifier_per_token_ms=rng.choice([0.0, rng.uniform(0, 0.5)]),
        layers=rng.randint(1, 120),
        hidden=rng.choice([1024, 4096, 8192, 16384]),
    )
    return CostModel(tp=tp, allreduce_us=table, **{**params, **fixed})


def test_pcie_is_never_shallower_than_nvlink_when_it_costs_more_per_call():
    # The premise of the advisor (docs/trainer.md): a slower link is a larger fixed cost per all-reduce. Same evaluation, same
    # verifier and draft; PCIe's table is NVLink's plus a per-call excess.
    rng = random.Random(20261130)
    deeper = 0
    for _ in range(3000):
        curve = random_curve(rng)
        tp = rng.choice([1, 2, 4, 8])
        nvlink_table = rng.choice([NVLINK_ALLREDUCE_US, random_table(rng)])
        excess = rng.choice([0.0, 1e-9, rng.uniform(0, 300)])
        nvlink = random_cost(rng, nvlink_table, tp)
        pcie = replace(nvlink, allreduce_us=tuple((b, us + excess) for b, us in nvlink_table))
        evaluation = {"position_acceptance": curve}
        out = compare_interconnects(evaluation, tp, costs={"nvlink": nvlink, "pcie": pcie})
        depths = out.recommended_depth
        assert depths["pcie"] >= depths["nvlink"], (curve, nvlink, excess)
        assert out.note is None
        deeper += depths["pcie"] > depths["nvlink"]
    assert deeper > 30  # the property is exercised, not vacuous


def test_a_larger_fixed_round_cost_never_makes_the_depth_shallower():
    rng = random.Random(7)
    for _ in range(1000):
        evaluation = {"position_acceptance": random_curve(rng)}
        tp = rng.choice([1, 8])
        base = random_cost(rng, NVLINK_ALLREDUCE_US, tp)
        depths = [
            advise(evaluation, "nvlink", tp, replace(base, verifier_base_ms=base.verifier_base_ms + k)).recommended_depth
            for k in (0.0, 0.5, 3.0, 30.0)
        ]
        assert depths == sorted(depths), (evaluation, base)


def cost_ratio_condition(dear: CostModel, cheap: CostModel, depths: range) -> bool:
    """round(d')/round(d) no larger for `dear` than for `cheap`, for every d < d': the proof's premise."""
    return all(
        dear.round_ms(e) * cheap.round_ms(d) <= dear.round_ms(d) * cheap.round_ms(e)
        for d in depths for e in depths if d < e
    )


def test_the_ratio_condition_is_what_guarantees_the_order():
    # Proof sketch: d' beats d iff tau_d'/tau_d > round(d')/round(d). If the dearer model's ratio is never larger,
    # anything deeper that wins under the cheaper model wins under the dearer one too; picking the shallowest
    # of the (near-)best in both keeps ties from breaking it. Checked over arbitrary random tables.
    rng = random.Random(11)
    checked = 0
    for _ in range(3000):
        curve = random_curve(rng)
        tp = rng.choice([2, 8])
        cheap = random_cost(rng, random_table(rng), tp)
        dear = replace(cheap, allreduce_us=random_table(rng))
        if not cost_ratio_condition(dear, cheap, range(len(curve) + 1)):
            continue
        checked += 1
        out = compare_interconnects({"position_acceptance": curve}, tp, costs={"nvlink": cheap, "pcie": dear})
        assert out.recommended_depth["pcie"] >= out.recommended_depth["nvlink"]
    assert checked > 300


def test_default_pcie_is_nvlink_plus_a_fixed_latency_per_call():
    # 3 µs per ring step, 2*(tp-1) steps: 0 at tp=1, 6 µs at tp=2, 42 µs at tp=8.
    assert [pcie_extra_us_per_call(tp) for tp in (1, 2, 8, 16)] == [0.0, 6.0, 42.0, 90.0]
    nvlink, pcie = (CostModel.for_interconnect(name, 8) for name in INTERCONNECTS)
    assert pcie.allreduce_us == tuple((b, us + 42.0) for b, us in NVLINK_ALLREDUCE_US)
    for message in (100, 16384, 65536, 131072, 10**6, 10**8):  # within, below and beyond the table
        assert pcie.allreduce_latency_us(message) == pytest.approx(nvlink.allreduce_latency_us(message) + 42.0)
    # depth 3 at tp 8: 160 calls, each 42 µs dearer -> 6.72 ms more per round, whatever the depth
    assert [pcie.round_ms(d) - nvlink.round_ms(d) for d in range(10)] == pytest.approx([160 * 0.042] * 10)
    assert "PCIe estimate" in advise({"position_acceptance": [0.5]}, "pcie", 8).allreduce_basis
    assert "42 µs per call" in advise({"position_acceptance": [0.5]}, "pcie", 8).allreduce_basis


def test_default_tables_never_make_pcie_shallower_at_any_tp():
    # The product requirement, on the shipped defaults: same measurements, every tp in 1..16, many random
    # non-increasing curves (and random verifier/draft overrides, applied to both), never a shallower PCIe depth.
    rng = random.Random(20261201)
    deeper = 0
    for tp in range(1, 17):
        nvlink, pcie = (CostModel.for_interconnect(name, tp) for name in INTERCONNECTS)
        # The proof's premise holds for the defaults over every depth a curve here can have (and more).
        assert cost_ratio_condition(pcie, nvlink, range(33)), tp
        for i in range(400):
            evaluation = {"position_acceptance": random_curve(rng)}
            overrides = {} if i % 2 else dict(
                draft_step_ms=rng.choice([0.0, rng.uniform(0, 3)]),
                verifier_base_ms=rng.uniform(0.5, 60) / tp,
                verifier_per_token_ms=rng.choice([0.0, rng.uniform(0, 0.5)]),
                layers=rng.randint(1, 120),
                hidden=rng.choice([1024, 4096, 8192, 16384]),
            )
            out = compare_interconnects(evaluation, tp, **overrides)
            depths = out.recommended_depth
            assert depths["pcie"] >= depths["nvlink"], (tp, evaluation, overrides)
            assert out.note is None
            deeper += depths["pcie"] > depths["nvlink"]
    assert deeper > 100  # the property is exercised, not vacuous


def test_the_optional_p2p_disabled_table_is_bandwidth_bound_and_can_favour_shallower_depths():
    # Known limit of the NCCL_P2P_DISABLE=1 measurement, kept visible: its small-message time matches NVLink's
    # (even a little less) while each extra byte costs more, so the ratio condition fails and a typical curve
    # gets one depth less with it. compare_interconnects says so; the defaults give PCIe the deeper depth.
    nvlink = CostModel.for_interconnect("nvlink", 8)
    p2p = CostModel.for_interconnect("pcie", 8, allreduce_us=PCIE_P2P_DISABLED_ALLREDUCE_US)
    assert not cost_ratio_condition(p2p, nvlink, range(9))
    curve = {"position_acceptance": [0.8, 0.64, 0.5, 0.38, 0.27, 0.19, 0.13, 0.09]}
    out = compare_interconnects(curve, 8, costs={"nvlink": nvlink, "pcie": p2p})
    assert out.recommended_depth == {"nvlink": 6, "pcie": 5}
    assert "shallower depth than NVLink" in out.note and "pcie-p2p-disabled" in out.note
    assert "NCCL_P2P_DISABLE=1" in out.pcie.allreduce_basis and "measured" in out.nvlink.allreduce_basis
    default = compare_interconnects(curve, 8)
    assert default.recommended_depth["nvlink"] == 6 and default.recommended_depth["pcie"] >= 6
    assert default.note is None
    # A given table that is not the p2p-disabled one still gets the general note, without the p2p sentence.
    steep = CostModel.for_interconnect("pcie", 8, allreduce_us=((1024, 10.0), (1048576, 5000.0)))
    note = compare_interconnects(curve, 8, costs={"nvlink": nvlink, "pcie": steep}).note
    assert "bandwidth-bound" in note and "pcie-p2p-disabled" not in note


def test_default_tables_are_the_fixture_measurements():
    for name, table in (("allreduce-nvlink.json", NVLINK_ALLREDUCE_US),
                        ("allreduce-p2p-disabled.json", PCIE_P2P_DISABLED_ALLREDUCE_US)):
        data = json.loads((FIXTURES / name).read_text())
        assert data["world"] == 2
        assert tuple((row["bytes"], row["us"]) for row in data["allreduce"]) == table


def test_default_cost_model():
    cost = CostModel.for_interconnect("nvlink", 8)
    assert (cost.layers, cost.hidden, cost.allreduces_per_layer, cost.bytes_per_value) == (80, 8192, 2, 2)
    assert cost.verifier_base_ms == pytest.approx(5.0) and cost.verifier_per_token_ms == pytest.approx(0.0375)
    assert cost.draft_step_ms == 0.6
    assert CostModel.for_interconnect("pcie", 8).allreduce_us == pcie_allreduce_us(8)
    assert CostModel.for_interconnect("pcie", 1).allreduce_us == NVLINK_ALLREDUCE_US  # no ring steps at tp=1
    custom = CostModel.for_interconnect("pcie", 4, layers=32, hidden=4096, draft_step_ms=0.2)
    assert (custom.tp, custom.layers, custom.hidden, custom.draft_step_ms) == (4, 32, 4096, 0.2)
    assert custom.verifier_base_ms == pytest.approx(10.0)


def test_allreduce_latency_uses_the_lower_envelope_and_extends_linearly():
    cost = CostModel.for_interconnect("nvlink", 2)
    # The 72.31 µs at 16 KiB is noise: 64 KiB took 38.58 µs, and a smaller message is never slower.
    assert cost.allreduce_latency_us(16384) == pytest.approx(38.58)
    assert cost.allreduce_latency_us(100) == pytest.approx(38.58)
    assert cost.allreduce_latency_us(67108864) == pytest.approx(307.7)
    slope = (307.7 - 74.04) / (67108864 - 16777216)
    assert cost.allreduce_latency_us(2 * 67108864) == pytest.approx(307.7 + 67108864 * slope)
    messages = [2**k for k in range(8, 28)]
    assert [cost.allreduce_latency_us(m) for m in messages] == sorted(cost.allreduce_latency_us(m) for m in messages)


def test_communication_per_round():
    cost = CostModel.for_interconnect("nvlink", 8)
    # depth 3: 4 tokens * 8192 * 2 B = 64 KiB -> 38.58 µs, 160 calls
    assert cost.comm_ms(3) == pytest.approx(160 * 38.58 / 1000)
    assert CostModel.for_interconnect("nvlink", 1).comm_ms(3) == 0.0
    single = compare_interconnects({"position_acceptance": [0.9, 0.8]}, 1)
    assert single.nvlink.by_depth == single.pcie.by_depth


def test_compare_interconnects_shape_and_overrides():
    out = compare_interconnects(HAND_EVALUATION, 8, trained_ttt=1, layers=40)
    assert set(out.model_dump()) == {"tp", "recommended_depth", "nvlink", "pcie", "note"}
    assert advise(HAND_EVALUATION, "nvlink", 2, hand_cost()).allreduce_basis == "given all-reduce table"
    assert advise(HAND_EVALUATION, "nvlink", 1).allreduce_basis == "tp=1: no all-reduce"
    assert out.recommended_depth == {name: getattr(out, name).recommended_depth for name in INTERCONNECTS}
    assert out.nvlink.cost_model.layers == out.pcie.cost_model.layers == 40
    assert out.pcie.retrain.trained_ttt == 1
    with pytest.raises(ValueError, match="either cost models or overrides"):
        compare_interconnects(HAND_EVALUATION, 2, costs={"nvlink": hand_cost(), "pcie": hand_cost()}, layers=3)


def test_advice_is_json_ready():
    out = advise(HAND_EVALUATION, "pcie", 8, trained_ttt=1, retrain_seconds_by_ttt={3: 10.0}).model_dump(mode="json")
    assert json.loads(json.dumps(out)) == out
    assert {"recommended_depth", "by_depth", "retrain", "speedup_vs_no_speculation", "interconnect", "tp"} <= set(out)
    assert {"depth", "mean_accepted", "round_ms", "tokens_per_second"} <= set(out["by_depth"][0])


@pytest.mark.parametrize(
    ("evaluation", "words"),
    [
        ({"position_acceptance": []}, "non-empty"),
        ({}, "non-empty"),
        ([0.5], "must be an object"),
        ({"position_acceptance": [1.2]}, "outside"),
        ({"position_acceptance": [0.5, -0.1]}, "outside"),
        ({"position_acceptance": [float("nan")]}, "finite"),
        ({"position_acceptance": [True]}, "finite number"),
        ({"position_acceptance": ["0.5"]}, "finite number"),
        ({"position_acceptance": [0.5, 0.7]}, "must not increase"),
        ({"position_acceptance": [0.5], "by_depth": [{"depth": 2, "mean_accepted": 1.5}]}, "1..1"),
        ({"position_acceptance": [0.5], "by_depth": [{"depth": 1, "mean_accepted": 2.5}]}, "outside"),
        ({"position_acceptance": [0.5], "by_depth": [{"depth": 1, "mean_accepted": 0.9}]}, "outside"),
        ({"position_acceptance": [0.5], "by_depth": [{"depth": 1}]}, "need depth and mean_accepted"),
        ({"position_acceptance": [0.5, 0.4], "by_depth": [{"depth": 1, "mean_accepted": 1.5}] * 2}, "twice"),
        ({"position_acceptance": [0.5], "by_depth": {"depth": 1}}, "must be a list"),
    ],
)
def test_bad_evaluations_are_refused_with_a_reason(evaluation, words):
    with pytest.raises(ValueError, match=words):
        advise(evaluation, "nvlink", 8)


def test_bad_cost_inputs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="unknown interconnect 'infiniband'"):
        advise(HAND_EVALUATION, "infiniband", 8)
    with pytest.raises(ValueError, match="unknown interconnect"):
        CostModel.for_interconnect("nvswitch", 8)
    with pytest.raises(ValueError, match="tp must be"):
        CostModel.for_interconnect("nvlink", 0)
    with pytest.raises(ValueError, match="unknown cost model field"):
        CostModel.for_interconnect("nvlink", 8, draft_ms=1.0)
    with pytest.raises(ValueError, match="cost model is for tp=2"):
        advise(HAND_EVALUATION, "nvlink", 8, hand_cost())
    with pytest.raises(ValueError, match="draft_step_ms"):
        CostModel(**{**HAND, "draft_step_ms": -1.0})
    with pytest.raises(ValueError, match="verifier_base_ms must be > 0"):
        CostModel(**{**HAND, "verifier_base_ms": 0.0})
    with pytest.raises(ValueError, match="allreduce_us is empty"):
        CostModel(**{**HAND, "allreduce_us": ()})
    with pytest.raises(ValueError, match="layers"):
        CostModel(**{**HAND, "layers": 0})
    with pytest.raises(ValueError, match="min_gain"):
        advise(HAND_EVALUATION, "nvlink", 2, hand_cost(), min_gain=-0.1)


def write(tmp_path: Path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_cli_single_interconnect(tmp_path, capsys):
    evaluation = write(tmp_path, "eval.json", HAND_EVALUATION)
    rc = main(["advise", "--evaluation", evaluation, "--interconnect", "pcie", "--tp", "8", "--draft-ms", "0.3",
                      "--verifier-ms", "4", "--layers", "40", "--hidden", "5120", "--trained-ttt", "1",
                      "--retrain-seconds", "3=600"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["interconnect"] == "pcie" and out["tp"] == 8
    cost = out["cost_model"]
    assert (cost["draft_step_ms"], cost["verifier_base_ms"], cost["layers"], cost["hidden"]) == (0.3, 4.0, 40, 5120)
    assert out["retrain"]["trained_ttt"] == 1
    expected = advise(HAND_EVALUATION, "pcie", 8, CostModel.for_interconnect(
        "pcie", 8, draft_step_ms=0.3, verifier_base_ms=4.0, layers=40, hidden=5120), 1, {3: 600.0})
    assert out == expected.model_dump(mode="json")


def test_cli_prices_the_verifier_of_a_config_json_and_vllms_placement_by_version(tmp_path, capsys):
    evaluation = write(tmp_path, "eval.json", {"position_acceptance": [0.8 ** i for i in range(1, 9)]})
    kimi = str(FIXTURES.parent / "verifiers" / "kimi-k2.5")
    rc = main(["advise", "--evaluation", evaluation, "--interconnect", "nvlink", "--tp", "8", "--engine", "vllm",
               "--draft-tp", "1", "--verifier", kimi, "--ep", "8"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert "384 routed experts" in out["cost_model"]["priced_verifier"]
    assert out["by_depth"][0]["terms"]["verifier_alltoalls"] == 120  # dispatch + combine in 60 MoE layers
    assert out["drafting"]["sharded"] and "draft_tp=1 is not honoured" in out["drafting"]["placement"]
    rc = main(["advise", "--evaluation", evaluation, "--interconnect", "nvlink", "--tp", "8", "--engine", "vllm",
               "--draft-tp", "1", "--engine-version", "v0"])
    assert rc == 0 and not json.loads(capsys.readouterr().out)["drafting"]["sharded"]


def test_cli_both_and_own_table(tmp_path, capsys):
    evaluation = write(tmp_path, "eval.json", HAND_EVALUATION)
    assert main(["advise", "--evaluation", evaluation]) == 0
    both = json.loads(capsys.readouterr().out)
    assert set(both["recommended_depth"]) == {"nvlink", "pcie"} and both["tp"] == 8
    table = write(tmp_path, "ar.json", {"world": 8, "allreduce": [{"bytes": 1024, "us": 90.0}]})
    assert main(["advise", "--evaluation", evaluation, "--interconnect", "pcie", "--allreduce-table", table]) == 0
    assert json.loads(capsys.readouterr().out)["cost_model"]["allreduce_us"] == [[1024, 90.0]]
    assert main(["advise", "--evaluation", evaluation, "--interconnect", "pcie", "--allreduce-table",
                        "pcie-p2p-disabled"]) == 0
    named = json.loads(capsys.readouterr().out)
    assert named["cost_model"]["allreduce_us"] == [list(row) for row in PCIE_P2P_DISABLED_ALLREDUCE_US]
    assert "NCCL_P2P_DISABLE=1" in named["allreduce_basis"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--evaluation", "{missing}"], "No such file"),
        (["--evaluation", "{bad}"], "outside"),
        (["--evaluation", "{good}", "--interconnect", "ib"], "'ib' is not one of"),
        (["--evaluation", "{good}", "--allreduce-table", "{good}"], "pick --interconnect"),
        (["--evaluation", "{good}", "--tp", "0"], "tp must be"),
        (["--evaluation", "{good}", "--retrain-seconds", "five=10"], "TTT=SECONDS"),
        (["--evaluation", "{good}", "--interconnect", "pcie", "--allreduce-table", "{good}"], "expected"),
        (["--evaluation", "{notjson}"], "is not JSON"),
    ],
)
def test_cli_errors_exit_2_with_the_reason(tmp_path, capsys, argv, words):
    paths = {
        "missing": str(tmp_path / "nope.json"),
        "bad": write(tmp_path, "bad.json", {"position_acceptance": [1.5]}),
        "good": write(tmp_path, "good.json", HAND_EVALUATION),
        "notjson": str(tmp_path / "notjson.json"),
    }
    (tmp_path / "notjson.json").write_text("not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["advise", *(arg.format(**paths) for arg in argv)])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_tokens_per_second_is_finite_for_extreme_but_valid_inputs():
    out = advise({"position_acceptance": [1.0] * 12}, "pcie", 8)
    assert out.recommended_depth == 12
    assert all(math.isfinite(row.tokens_per_second) for row in out.by_depth)


def test_the_advisor_is_plain_arithmetic():
    # The server must not need torch: importing the advisor pulls in neither torch nor the trainer.
    code = "import sys, server.advisor; sys.exit(any(m.split('.')[0] in ('torch', 'trainer') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2]).returncode == 0
