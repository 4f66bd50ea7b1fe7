"""The algorithm: the depth to serve and whether a deeper TTT retrain pays off (see server/advisor)."""

from __future__ import annotations

from dataclasses import replace

from server.advisor import rule_record
from server.advisor.cost import CostModel, check_number
from server.advisor.engine import Drafting, EngineCost, drafting_public
from server.advisor.results import (
    Advice,
    DepthSpeed,
    FrontierRow,
    InterconnectComparison,
    NoSpeculation,
    Objective,
    RetrainAdvice,
)
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
UNKNOWN_LINKS = "unknown"
# A retrain's TTT: the smallest within this share of the best objective (net gain, else tokens/s).
PICK_WITHIN = 0.01
# Positions must be non-increasing; allow rounding in files written with few decimals.
_ORDER_SLACK = 1e-9

RETRAIN_ASSUMPTION = (
    "positions beyond the trained TTT depth T improve until they follow the decay seen inside it: "
    "a_i = a_T * r^(i-T), r the geometric-mean ratio a_(i+1)/a_i over positions 1..T (for T = 1, r = a_1: "
    "each token accepted independently at the first position's rate); positions already better keep their value, "
    "and positions up to T do not change. A retrain at TTT N lifts positions T+1..N so; positions beyond N keep "
    "their conditional rates. With step_acceptance (the simulation's sim_step_acc_k: proposal k right over every "
    "round, not only those that survived k-1 proposals) the decay is read from it instead, and a position beyond T "
    "is lifted by the factor that brings its step rate up to u_T * r_u^(i-T), r_u the geometric-mean step ratio "
    "over 1..T (1 for T = 1; at most 1), applied to its conditional rate. Bounded by the rule's record: no lifted "
    "position above the highest acceptance a deeper draft measured there (rule_record.HIGHEST_ACCEPTANCE), no "
    "candidate TTT past the deepest the record trained (rule_record.DEEPEST_MEASURED)"
)

# Why step_acceptance: the conditional rate at position k is taken over the rounds that survived k-1 proposals,
# which are the easy contexts, so it climbs with depth by selection alone and hides a draft that gets worse past
# its trained depth (trainer/simulate.py, "Survivor bias"); the step rate's denominator is every round.


def _read_evaluation(evaluation: dict) -> tuple[dict[int, float], list[float], list[float] | None]:
    """Mean accepted length by depth, the per-position acceptance and the optional step acceptance, validated.

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
    step = evaluation.get("step_acceptance")
    if step is not None:
        if not isinstance(step, list) or len(step) < len(positions):
            raise ValueError("evaluation.step_acceptance must list a probability for every position "
                             "(proposal k right over every round, sim_step_acc_k)")
        step = [check_number(a, f"step_acceptance[{i}]", 0, 1) for i, a in enumerate(step[:len(positions)])]
    return taus, positions, step


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
    # links a probe could not read are "unknown": priced on the table measured over them, never named pcie
    if interconnect != UNKNOWN_LINKS or cost is None:
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
    objective: Objective | None = None,
) -> Advice:
    """Expected tokens/s per depth, the depth to serve (0: do not speculate) and whether a deeper TTT pays off.
    allreduce_basis says where a given cost model's all-reduce table comes from (else it is recognised).
    With drafting, the round is priced the way that engine runs the draft (server/advisor/engine.py) and every
    depth shows its terms."""
    taus, positions, step = _read_evaluation(evaluation)
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
                              min_gain, objective or Objective(), step)
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
        cost_model=replace(cost, basis={**cost.basis, "allreduce_times": allreduce_basis or _allreduce_basis(cost),
                                        **({"draft_placement": drafting.placement(tp)} if drafting else {})}),
        drafting=drafting_public(drafting, tp) if drafting is not None else None,
    )


def improved_positions(positions: list[float], trained_ttt: int, step: list[float] | None = None) -> list[float]:
    """Acceptance per position expected after training with a deeper TTT, under RETRAIN_ASSUMPTION; with `step`
    (each position's step acceptance, over every round) the decay and each position's lift are read from it."""
    t = trained_ttt
    if t >= len(positions):
        return list(positions)
    if step is None:
        ratio = _inside_ratio(positions, t)
        lifted = positions[:t] + [max(a, positions[t - 1] * ratio**k) for k, a in enumerate(positions[t:], start=1)]
        return _bounded(positions, lifted)
    ratio = _step_ratio(step, t)
    out, lifting = positions[:t], False
    for i, conditional in enumerate(_conditional(positions)[t:], start=t):
        target = step[t - 1] * ratio ** (i - t + 1)
        lifted = min(1.0, conditional * target / step[i]) if step[i] > 0 else target
        lifting = lifting or lifted > conditional
        # the measured value itself until a position is lifted (so an unlifted draft compares equal)
        out.append(out[-1] * max(conditional, lifted) if lifting else positions[i])
    return _bounded(positions, out)


def _bounded(positions: list[float], lifted: list[float]) -> list[float]:
    """`lifted` with no position's conditional rate lifted above what the rule's record measured a deeper draft
    reach (rule_record.HIGHEST_ACCEPTANCE); a rate measured higher already keeps its value."""
    if lifted == positions:
        return lifted
    measured, after = _conditional(positions), _conditional(lifted)
    out, capped = [], False
    for i, (a, b) in enumerate(zip(measured, after, strict=True)):
        bound = max(a, rule_record.HIGHEST_ACCEPTANCE)
        if b > bound or capped:  # from the first capped position on, the products are rebuilt
            capped = True
            out.append((out[-1] if out else 1.0) * min(b, bound))
        else:
            out.append(lifted[i])
    return out


def _step_ratio(step: list[float], t: int) -> float:
    """RETRAIN_ASSUMPTION's r_u: the geometric-mean ratio of the step rates over positions 1..t (1 for t = 1), at
    most 1."""
    if t == 1:
        return 1.0
    # at most 1: a deeper TTT is not expected to make later proposals better than the trained depth's last one
    return min(1.0, (step[t - 1] / step[0]) ** (1 / (t - 1))) if step[0] > 0 else 0.0


def _inside_ratio(positions: list[float], t: int) -> float:
    """RETRAIN_ASSUMPTION's r: the geometric-mean ratio P(1..i+1)/P(1..i) over positions 1..t (a_1 for t = 1)."""
    if t == 1:
        return positions[0]
    return (positions[t - 1] / positions[0]) ** (1 / (t - 1)) if positions[0] > 0 else 0.0


def _conditional(positions: list[float]) -> list[float]:
    """Acceptance at each position given the earlier ones were: P(1..k) / P(1..k-1)."""
    return [p / q if q > 0 else 0.0 for p, q in zip(positions, [1.0, *positions], strict=False)]


def _nothing_to_lift(positions: list[float], trained_ttt: int, step: list[float] | None = None) -> str:
    """Why a deeper TTT is expected to gain nothing: beyond the trained depth the draft already accepts at or above
    the decay inside it (RETRAIN_ASSUMPTION), the figures a user can check."""
    if step is not None:
        inside = _step_ratio(step, trained_ttt)
        beyond = " ".join(f"{a:.2f}" for a in step[trained_ttt:])
        return (f"a deeper TTT is expected to gain nothing: beyond the trained depth {trained_ttt} the draft's "
                f"proposals are right {beyond} at positions {trained_ttt + 1}..{len(positions)} over every round "
                f"(sim_step_acc_k, no survivor bias), at or above the {step[trained_ttt - 1]:.3f} x {inside:.3f} per "
                "position it keeps inside it; a deeper TTT lifts only positions below that decay (the assumption)")
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


def lifted_positions(positions: list[float], trained_ttt: int, ttt: int, step: list[float] | None = None) -> list[float]:
    """Acceptance per position after a retrain at TTT `ttt`: positions up to `ttt` as improved_positions lifts
    them, those beyond keep their conditional rates (P(1..i) / P(1..i-1)) on top of the lifted prefix."""
    better = improved_positions(positions, trained_ttt, step)
    out = better[:ttt]
    for i in range(ttt, len(positions)):
        out.append(out[-1] * (positions[i] / positions[i - 1] if positions[i - 1] > 0 else 0.0))
    return out


def break_even_tokens(extra_gpu_seconds: float, tp: int, tps_now: float, tps_after: float) -> float | None:
    """Tokens served until a retrain's extra training GPU-time is won back: each token served at tps_after instead
    of tps_now saves tp x (1/tps_now - 1/tps_after) GPU-seconds on the serving group. The one definition every
    answer uses (0: it costs no more than finishing; None: it serves no faster)."""
    saved = tp * (1 / tps_now - 1 / tps_after) if tps_now > 0 and tps_after > 0 else 0.0
    if saved <= 0:
        return None
    return max(0.0, extra_gpu_seconds) / saved


def _frontier_row(cost: CostModel | EngineCost, taus: dict[int, float], positions: list[float], trained: int,
                  ttt: int, tps_now: float, by_ttt: dict[int, float] | None, objective: Objective,
                  step: list[float] | None = None) -> FrontierRow:
    after = lifted_positions(positions, trained, ttt, step)
    # only the improvement is added, so a measured tau keeps its own value at and below the trained depth
    taus_after = {d: tau + sum(after[:d]) - sum(positions[:d]) for d, tau in taus.items()}
    speeds = {0: 1000 / cost.round_ms(0), **{d: 1000 * tau / cost.round_ms(d) for d, tau in taus_after.items()}}
    depth = _shallowest_best(speeds)
    row = FrontierRow(ttt=ttt, depth=depth, tokens_per_second=speeds[depth], gain=speeds[depth] / tps_now - 1)
    seconds, _ = _training_seconds(ttt, by_ttt)
    if seconds is None:
        return row
    gpus = objective.train_gpus
    extra = (seconds - objective.remaining_seconds) * gpus
    row.training_seconds, row.training_hours = seconds, seconds / 3600
    row.gpu_hours, row.extra_gpu_hours = seconds * gpus / 3600, extra / 3600
    row.break_even_tokens = break_even_tokens(extra, cost.tp, tps_now, row.tokens_per_second)
    if objective.serve_tokens is not None:
        saved = objective.serve_tokens * cost.tp * (1 / tps_now - 1 / row.tokens_per_second) / 3600
        row.net_gpu_hours = saved - extra / 3600
        if objective.train_gpu_hour_price is not None and objective.serve_gpu_hour_price is not None:
            row.net_value = saved * objective.serve_gpu_hour_price - extra / 3600 * objective.train_gpu_hour_price
    return row


def _objective_value(row: FrontierRow, objective: Objective) -> float | None:
    if objective.serve_tokens is None:
        return row.tokens_per_second
    return row.net_value if objective.train_gpu_hour_price is not None else row.net_gpu_hours


def _describe_objective(objective: Objective, priced: bool) -> str:
    if objective.serve_tokens is None:
        return ("the fastest serving (no deploy.serve_tokens: training cost not weighed), the smallest TTT within "
                f"{PICK_WITHIN:.0%} of the best tokens/s")
    what = ("net value: serving GPU-hours saved x serve price less extra training GPU-hours x train price"
            if objective.train_gpu_hour_price is not None else
            "net GPU-hours: serving GPU-hours saved less extra training GPU-hours")
    unknown = "" if priced else " (training time unknown: picked by tokens/s instead)"
    return (f"{what} over {objective.serve_tokens:.3g} tokens served, the smallest TTT within {PICK_WITHIN:.0%} of "
            f"the best{unknown}")


def _retrain_advice(
    cost: CostModel | EngineCost,
    taus: dict[int, float],
    positions: list[float],
    depth_now: int,
    tps_now: float,
    trained_ttt: int | None,
    retrain_seconds_by_ttt: dict[int, float] | None,
    min_gain: float,
    objective: Objective,
    step: list[float] | None = None,
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

    if improved_positions(positions, trained_ttt, step) == positions:
        advice.depth_after, advice.tokens_per_second_after, advice.gain = depth_now, tps_now, 0.0
        advice.reason = _nothing_to_lift(positions, trained_ttt, step)
        return advice
    deepest = min(max(taus), rule_record.DEEPEST_MEASURED)
    if trained_ttt >= deepest:
        advice.reason = (f"the retrain rule's record trained no draft deeper than TTT={rule_record.DEEPEST_MEASURED} "
                         f"({rule_record.SOURCE}): a restart past TTT={trained_ttt} is not predicted")
        return advice
    rows = [_frontier_row(cost, taus, positions, trained_ttt, t, tps_now, retrain_seconds_by_ttt, objective, step)
            for t in range(trained_ttt + 1, deepest + 1)]
    advice.frontier = rows
    fastest = max(rows, key=lambda r: (r.tokens_per_second, -r.ttt))
    advice.depth_after, advice.tokens_per_second_after, advice.gain = (
        fastest.depth, fastest.tokens_per_second, fastest.gain)
    if fastest.depth <= trained_ttt:
        advice.depth_after, advice.tokens_per_second_after, advice.gain = depth_now, tps_now, 0.0
        advice.reason = (
            f"even with better acceptance beyond position {trained_ttt}, depth {fastest.depth} stays the fastest, "
            f"within the trained TTT depth {trained_ttt}: a deeper TTT would not speed up serving"
        )
        return advice
    eligible = [r for r in rows if r.gain >= min_gain and r.depth > trained_ttt]
    priced = objective.serve_tokens is not None and bool(eligible) and all(r.training_seconds is not None
                                                                          for r in eligible)
    judged = objective if priced else objective.model_copy(update={"serve_tokens": None})
    advice.objective = _describe_objective(objective, priced or objective.serve_tokens is None)
    if not eligible:
        advice.suggested_ttt_steps = fastest.ttt
        advice.reason = (f"serving at depth {fastest.depth} after a TTT-{fastest.ttt} retrain is expected to give "
                         f"{fastest.tokens_per_second:.1f} tokens/s instead of {tps_now:.1f} at depth {depth_now} now "
                         f"({fastest.gain:+.1%}), below the {min_gain:.0%} worth a retrain")
        return advice
    values = {r.ttt: _objective_value(r, judged) for r in eligible}
    best = max(values.values())
    pick = next(r for r in eligible if values[r.ttt] >= best - PICK_WITHIN * abs(best))
    advice.suggested_ttt_steps, advice.depth_after = pick.ttt, pick.depth
    advice.tokens_per_second_after, advice.gain = pick.tokens_per_second, pick.gain
    seconds, basis = _training_seconds(pick.ttt, retrain_seconds_by_ttt)
    advice.predicted_training_seconds, advice.training_seconds_basis = seconds, basis
    change = (
        f"serving at depth {pick.depth} after a TTT-{pick.ttt} retrain is expected to give "
        f"{pick.tokens_per_second:.1f} tokens/s instead of {tps_now:.1f} at depth {depth_now} now ({pick.gain:+.1%})"
    )
    if priced and best <= 0:
        advice.reason = (f"{change}, but no deeper TTT wins back its training within the "
                         f"{objective.serve_tokens:.3g} tokens the deployment serves (best net {best:.3g}"
                         f"{' GPU-h' if objective.train_gpu_hour_price is None else ''}, TTT={pick.ttt})")
        return advice
    advice.pays_off = True
    if seconds is None:
        advice.reason = f"{change}; training time unknown (give retrain_seconds_by_ttt to weigh it)"
        return advice
    advice.break_even_tokens = pick.break_even_tokens
    advice.reason = f"{change}; {training_cost(pick, objective, cost.tp)}"
    if priced:
        advice.reason += f"; net {values[pick.ttt]:.3g}{' GPU-h' if objective.train_gpu_hour_price is None else ''} " \
                         f"over {objective.serve_tokens:.3g} tokens served"
    return advice


def training_cost(row: FrontierRow, objective: Objective, tp: int) -> str:
    """The retrain's cost and its break-even, in the words every surface uses."""
    text = (f"{row.training_seconds:.0f} s of training ({row.gpu_hours:.3g} GPU-h on {objective.train_gpus} "
            f"GPU(s)), {row.extra_gpu_hours:+.3g} GPU-h against finishing this attempt")
    if row.break_even_tokens is not None:
        text += (f", won back after {row.break_even_tokens:.3g} tokens served (the GPU-time saved on the tp={tp} "
                 "serving GPUs)")
    return text


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
