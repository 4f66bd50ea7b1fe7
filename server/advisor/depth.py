"""The algorithm: the depth to serve and whether a deeper TTT retrain pays off (see server/advisor)."""

from __future__ import annotations

from server.advisor.cost import CostModel, check_number
from server.advisor.engine import Drafting, EngineCost, drafting_public
from server.advisor.results import Advice, DepthSpeed, InterconnectComparison, NoSpeculation, RetrainAdvice
from server.advisor.tables import (
    INTERCONNECTS,
    NVLINK_ALLREDUCE_US,
    PCIE_P2P_DISABLED_ALLREDUCE_US,
    PCIE_US_PER_RING_STEP,
    check_interconnect,
    pcie_allreduce_us,
    pcie_extra_us_per_call,
)

# Tokens/s within this relative distance of the best count as a tie (float rounding), resolved to the shallower.
_TIE = 1e-9
# Positions must be non-increasing; allow rounding in files written with few decimals.
_ORDER_SLACK = 1e-9

RETRAIN_ASSUMPTION = (
    "positions beyond the trained TTT depth T improve until they follow the decay seen inside it: "
    "a_i = a_T * r^(i-T), r the geometric-mean ratio a_(i+1)/a_i over positions 1..T (for T = 1, r = a_1: "
    "each token accepted independently at the first position's rate); positions already better keep their value, "
    "and positions up to T do not change"
)


def _read_evaluation(evaluation: dict) -> tuple[dict[int, float], list[float]]:
    """Mean accepted length by depth and the per-position acceptance, validated.

    tau comes from by_depth where measured, else from 1 + the sum of position_acceptance.
    """
    if not isinstance(evaluation, dict):
        raise ValueError("evaluation must be an object with position_acceptance and by_depth")
    positions_in = evaluation.get("position_acceptance")
    if not isinstance(positions_in, list) or not positions_in:
        raise ValueError("evaluation.position_acceptance must be a non-empty list of probabilities")
    positions = []
    for i, a in enumerate(positions_in):
        positions.append(check_number(a, f"position_acceptance[{i}] (P(tokens 1..{i + 1} all accepted))", 0, 1))
        if i and positions[i] > positions[i - 1] + _ORDER_SLACK:
            raise ValueError(
                f"position_acceptance must not increase: [{i}] = {positions[i]} > [{i - 1}] = {positions[i - 1]}. "
                "Each entry is the probability that this and every earlier drafted token are accepted; "
                "per-position conditional rates must be multiplied out first."
            )
    taus = {d: 1.0 + sum(positions[:d]) for d in range(1, len(positions) + 1)}
    rows = evaluation.get("by_depth") or []
    if not isinstance(rows, list):
        raise ValueError("evaluation.by_depth must be a list of {depth, mean_accepted}")
    seen = set()
    for row in rows:
        if not isinstance(row, dict) or "depth" not in row or "mean_accepted" not in row:
            raise ValueError(f"evaluation.by_depth entries need depth and mean_accepted, got {row!r}")
        depth = row["depth"]
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= len(positions):
            raise ValueError(
                f"by_depth depth {depth!r} must be a whole number in 1..{len(positions)} "
                "(position_acceptance must cover every evaluated depth)"
            )
        if depth in seen:
            raise ValueError(f"by_depth lists depth {depth} twice")
        seen.add(depth)
        taus[depth] = check_number(row["mean_accepted"], f"by_depth mean_accepted at depth {depth}", 1, depth + 1)
    return taus, positions


def _allreduce_basis(cost: CostModel) -> str:
    if cost.tp == 1:
        return "tp=1: no all-reduce"
    if cost.allreduce_us == NVLINK_ALLREDUCE_US:
        return "measured: NCCL all-reduce on 2 H200s over NVLink (NV18), used as-is for this tp"
    if cost.allreduce_us == pcie_allreduce_us(cost.tp):
        return (f"PCIe estimate: the NVLink measurement plus {pcie_extra_us_per_call(cost.tp):g} µs per call "
                f"({PCIE_US_PER_RING_STEP:g} µs x 2*(tp-1) ring steps, from published nccl-tests small-message "
                "latencies); give a table measured on the serving box")
    if cost.allreduce_us == PCIE_P2P_DISABLED_ALLREDUCE_US:
        return ("pcie-p2p-disabled: 2 H200s with NCCL_P2P_DISABLE=1 (through host memory), not a real PCIe "
                "switch; bandwidth-bound, so it can favour shallower depths than NVLink")
    return "given all-reduce table"


def _shallowest_best(tokens_per_second: dict[int, float]) -> int:
    top = max(tokens_per_second.values())
    return min(d for d, tps in tokens_per_second.items() if tps >= top * (1 - _TIE))


def _cost_for(interconnect: str, tp: int, cost: CostModel | None) -> CostModel:
    check_interconnect(interconnect)
    if cost is None:
        return CostModel.for_interconnect(interconnect, tp)
    if cost.tp != tp:
        raise ValueError(f"cost model is for tp={cost.tp} but advice was asked for tp={tp}")
    return cost


def advise(
    evaluation: dict,
    interconnect: str,
    tp: int,
    cost: CostModel | None = None,
    trained_ttt: int | None = None,
    retrain_seconds_by_ttt: dict[int, float] | None = None,
    min_gain: float = 0.02,
    allreduce_basis: str | None = None,
    drafting: Drafting | None = None,
) -> Advice:
    """Expected tokens/s per depth, the depth to serve (0: do not speculate) and whether a deeper TTT pays off.
    allreduce_basis says where a given cost model's all-reduce table comes from (else it is recognised).
    With drafting, the round is priced the way that engine runs the draft (server/advisor/engine.py) and every
    depth shows its terms."""
    taus, positions = _read_evaluation(evaluation)
    cost = _cost_for(interconnect, tp, cost)
    check_number(min_gain, "min_gain", low=0.0)
    rounds = EngineCost(cost, drafting) if drafting is not None else cost
    if drafting is not None and drafting.engine == "measured":
        taus = {d: tau for d, tau in taus.items() if d in (drafting.round_ms or {})}
        if not taus:
            raise ValueError(f"round_ms covers none of the evaluated depths 1..{len(positions)}")
    by_depth = [
        DepthSpeed(depth=d, mean_accepted=tau, round_ms=rounds.round_ms(d),
                   tokens_per_second=1000 * tau / rounds.round_ms(d),
                   terms=rounds.terms(d) if drafting is not None else None)
        for d, tau in sorted(taus.items())
    ]
    plain = 1000 / rounds.round_ms(0)
    speeds = {0: plain, **{row.depth: row.tokens_per_second for row in by_depth}}
    depth = _shallowest_best(speeds)
    retrain = _retrain_advice(rounds, taus, positions, depth, speeds[depth], trained_ttt, retrain_seconds_by_ttt,
                              min_gain)
    if drafting is not None and drafting.topk > 1:
        retrain.reason += (f" (the top-{drafting.topk} tree's acceptance taken as the chain's, a lower bound: "
                           "drafting.acceptance)")
    return Advice(
        interconnect=interconnect,
        tp=tp,
        recommended_depth=depth,
        tokens_per_second=speeds[depth],
        speedup_vs_no_speculation=speeds[depth] / plain,
        no_speculation=NoSpeculation(round_ms=rounds.round_ms(0), tokens_per_second=plain),
        by_depth=by_depth,
        allreduce_basis=allreduce_basis or _allreduce_basis(cost),
        retrain=retrain,
        cost_model=cost,
        drafting=drafting_public(drafting, tp) if drafting is not None else None,
    )


def improved_positions(positions: list[float], trained_ttt: int) -> list[float]:
    """Acceptance per position expected after training with a deeper TTT, under RETRAIN_ASSUMPTION."""
    t = trained_ttt
    if t >= len(positions):
        return list(positions)
    ratio = _inside_ratio(positions, t)
    return positions[:t] + [max(a, positions[t - 1] * ratio**k) for k, a in enumerate(positions[t:], start=1)]


def _inside_ratio(positions: list[float], t: int) -> float:
    """RETRAIN_ASSUMPTION's r: the geometric-mean ratio P(1..i+1)/P(1..i) over positions 1..t (a_1 for t = 1)."""
    if t == 1:
        return positions[0]
    return (positions[t - 1] / positions[0]) ** (1 / (t - 1)) if positions[0] > 0 else 0.0


def _conditional(positions: list[float]) -> list[float]:
    """Acceptance at each position given the earlier ones were: P(1..k) / P(1..k-1)."""
    return [p / q if q > 0 else 0.0 for p, q in zip(positions, [1.0, *positions], strict=False)]


def _nothing_to_lift(positions: list[float], trained_ttt: int) -> str:
    """Why a deeper TTT is expected to gain nothing: beyond the trained depth the draft already accepts at or above
    the decay inside it (RETRAIN_ASSUMPTION), the figures a user can check."""
    conditional = _conditional(positions)
    inside = _inside_ratio(positions, trained_ttt)
    beyond = " ".join(f"{a:.2f}" for a in conditional[trained_ttt:])
    return (f"a deeper TTT is expected to gain nothing: beyond the trained depth {trained_ttt} the draft already "
            f"accepts {beyond} at positions {trained_ttt + 1}..{len(positions)} (each given the earlier ones), at or "
            f"above the {inside:.3f} per position it keeps inside it; a deeper TTT lifts only positions below that "
            "decay (the assumption)")


def _training_seconds(ttt: int, by_ttt: dict[int, float] | None) -> tuple[float | None, str | None]:
    """Predicted retrain time: as given for that TTT, else a straight line through the given ones."""
    if not by_ttt:
        return None, None
    if ttt in by_ttt:
        return float(by_ttt[ttt]), f"given for ttt_steps={ttt}"
    if len(by_ttt) < 2:
        return None, None
    # One TTT step adds about one forward and backward of the draft per batch, so time is linear in TTT steps.
    xs, ys = zip(*sorted(by_ttt.items()), strict=True)
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    seconds = mean_y + slope * (ttt - mean_x)
    if seconds <= 0:
        return None, None
    return seconds, f"linear in ttt_steps through the times given for {list(xs)}"


def _retrain_advice(
    cost: CostModel | EngineCost,
    taus: dict[int, float],
    positions: list[float],
    depth_now: int,
    tps_now: float,
    trained_ttt: int | None,
    retrain_seconds_by_ttt: dict[int, float] | None,
    min_gain: float,
) -> RetrainAdvice:
    if trained_ttt is not None and (isinstance(trained_ttt, bool) or not isinstance(trained_ttt, int) or trained_ttt < 1):
        raise ValueError(f"trained_ttt must be a whole number >= 1, got {trained_ttt!r}")
    advice = RetrainAdvice(trained_ttt=trained_ttt, tokens_per_second_now=tps_now, assumption=RETRAIN_ASSUMPTION)
    if trained_ttt is None:
        advice.reason = "the draft's trained TTT depth is unknown; give trained_ttt to judge a deeper retrain"
        return advice
    if trained_ttt >= max(taus):
        advice.reason = (
            f"the evaluation stops at depth {max(taus)}, within the trained TTT depth {trained_ttt}: "
            "evaluate deeper (--max-depth) to judge a deeper TTT"
        )
        return advice

    better = improved_positions(positions, trained_ttt)
    if better == positions:
        advice.depth_after, advice.tokens_per_second_after, advice.gain = depth_now, tps_now, 0.0
        advice.reason = _nothing_to_lift(positions, trained_ttt)
        return advice
    # Only the improvement is added, so a measured tau keeps its own value at and below the trained depth.
    taus_after = {d: tau + sum(better[:d]) - sum(positions[:d]) for d, tau in taus.items()}
    speeds_after = {0: 1000 / cost.round_ms(0), **{d: 1000 * tau / cost.round_ms(d) for d, tau in taus_after.items()}}
    depth_after = _shallowest_best(speeds_after)
    tps_after = speeds_after[depth_after]
    gain = tps_after / tps_now - 1
    advice.depth_after, advice.tokens_per_second_after, advice.gain = depth_after, tps_after, gain
    if depth_after <= trained_ttt:
        advice.reason = (
            f"even with better acceptance beyond position {trained_ttt}, depth {depth_after} stays the fastest, "
            f"within the trained TTT depth {trained_ttt}: a deeper TTT would not speed up serving"
        )
        return advice

    seconds, basis = _training_seconds(depth_after, retrain_seconds_by_ttt)
    advice.suggested_ttt_steps = depth_after
    advice.predicted_training_seconds, advice.training_seconds_basis = seconds, basis
    change = (
        f"serving at depth {depth_after} after a TTT-{depth_after} retrain is expected to give "
        f"{tps_after:.1f} tokens/s instead of {tps_now:.1f} at depth {depth_now} now ({gain:+.1%})"
    )
    if gain < min_gain:
        advice.reason = f"{change}, below the {min_gain:.0%} worth a retrain"
        return advice
    advice.pays_off = True
    if seconds is None:
        advice.reason = f"{change}; training time unknown (give retrain_seconds_by_ttt to weigh it)"
        return advice
    # Serving N tokens saves N * (1/now - 1/after) seconds; break-even when that equals the training time.
    advice.break_even_tokens = seconds / (1 / tps_now - 1 / tps_after)
    hours = advice.break_even_tokens / tps_after / 3600
    advice.reason = (
        f"{change}; the {seconds:.0f} s of training is won back after {advice.break_even_tokens:.3g} generated "
        f"tokens (~{hours:.3g} h of serving on one group)"
    )
    return advice


def compare_interconnects(
    evaluation: dict,
    tp: int,
    trained_ttt: int | None = None,
    retrain_seconds_by_ttt: dict[int, float] | None = None,
    min_gain: float = 0.02,
    costs: dict[str, CostModel] | None = None,
    **overrides: object,
) -> InterconnectComparison:
    """advise() for every interconnect with the same measurements; overrides apply to each default cost model."""
    if costs is not None and overrides:
        raise ValueError("give either cost models or overrides, not both")
    advice = {}
    for name in INTERCONNECTS:
        cost = costs[name] if costs is not None else CostModel.for_interconnect(name, tp, **overrides)
        advice[name] = advise(evaluation, name, tp, cost, trained_ttt, retrain_seconds_by_ttt, min_gain)
    note = None
    if advice["pcie"].recommended_depth < advice["nvlink"].recommended_depth:
        note = (
            "PCIe gets a shallower depth than NVLink here: with these all-reduce tables its extra cost per call is "
            "not a fixed latency but grows with the tokens verified per round (bandwidth-bound), so deeper rounds "
            "cost it proportionally more."
        )
        if advice["pcie"].cost_model.allreduce_us == PCIE_P2P_DISABLED_ALLREDUCE_US:
            note += (
                " The pcie-p2p-disabled table is NVLink switched off on an NVLink box, so its small-message time "
                "matches NVLink's; a real PCIe box pays a larger fixed latency per call, which favours deeper "
                "speculation (the default PCIe estimate)."
            )
    return InterconnectComparison(
        tp=tp,
        recommended_depth={name: advice[name].recommended_depth for name in INTERCONNECTS},
        nvlink=advice["nvlink"],
        pcie=advice["pcie"],
        note=note,
    )
