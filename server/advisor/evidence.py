"""The evidence a depth proposal reads (server/proposal.py): the acceptance by draft position with its 90% intervals,
from the live simulation (sim_acc_k, sim_step_acc_k, Wilson intervals over the rounds behind them) or calibrated by
decoding, and the words every surface uses for it. Plain arithmetic over the run's latest values; no database."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from trainer import series

# the evidence's intervals: 90% two-sided, as decoding's bootstrap (trainer/evaluate.py CONFIDENCE)
CONFIDENCE = 0.9
Z = 1.6448536269514722  # the standard normal's 95th percentile

class Evidence(BaseModel):
    """Which acceptance decided: `simulation` (the live sim_acc_k, teacher-forced on validation data) or
    `decoding` (the newest evaluation's real decoding, which calibrates the live sim_acc_k per position)."""

    source: Literal["simulation", "decoding"]
    detail: str = Field(description="where the acceptance came from, and how it was calibrated")
    attempt: int | None = Field(None, description="the evaluated attempt (decoding)")
    acceptance: list[float] = Field(default_factory=list, description="[k-1]: the conditional acceptance at draft "
                                    "position k the decision read")
    acceptance_interval: list[list[float] | None] = Field(
        default_factory=list, description="[k-1]: the 90% interval of acceptance[k-1]: decoding's bootstrap over "
        "prompts carried through the calibration, or the simulation's Wilson interval over sim_rounds_k (null where "
        "there is none)")
    rounds: list[int] = Field(default_factory=list, description="[k-1]: the rounds behind acceptance[k-1] (decoding's "
                              "position_rounds, or sim_rounds_k)")
    prompts: int | None = Field(None, description="decoding: the prompts its bootstrap resampled")
    step_acceptance: list[float] = Field(default_factory=list, description="[k-1]: sim_step_acc_k, proposal k right "
                                         "over every round (no survivor bias), which the retrain rule reads with "
                                         "simulation evidence")
    step_acceptance_interval: list[list[float] | None] = Field(
        default_factory=list, description="[k-1]: its Wilson 90% interval over sim_scored_k rounds")
    interval: str = Field("", description="how the intervals were formed, over what, or why there are none")
    calibration: list[float] = Field(default_factory=list, description="[k-1]: decoding / simulation of the "
                                     "evaluated attempt at position k (beyond its depth, the deepest one's)")
    gain_interval: list[float] | None = Field(None, description="the proposed TTT's tokens/s gain at the "
                                              "interval's low and high ends")
    verdicts: list[str] = Field(default_factory=list, description="the verdict (restart or keep_going) at each end "
                                "of the interval: where they differ, the answer is cannot_tell")
    decay_from: Literal["sim_step_acc_k", "sim_acc_k"] = Field(
        "sim_acc_k", description="the rate the retrain rule reads the decay past the trained depth from: "
        "sim_step_acc_k (no survivor bias) where the trainer reports it, else sim_acc_k (an older trainer's run)")
    decay_note: str = Field("", description="why that rate, and what the fallback misses")
    settle: str = Field("", description="what would settle a cannot_tell: more validation rounds (about how many "
                        "times as many) or an evaluation")



def indexed_values(latest: dict[str, Any], base: str, n: int) -> list[float]:
    """`base`_1..n from the run's latest values, or [] unless every one is there (an older trainer's run)."""
    values = [latest.get(series.indexed(base, k)) for k in range(1, n + 1)]
    ok = all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in values)
    return [float(v) for v in values] if ok and n else []


def wilson(rate: float, n: float, z: float = Z) -> list[float] | None:
    """The Wilson score interval of a binomial rate observed over n trials (None for n = 0). It stays inside
    [0, 1] and is not degenerate at 0 or 1, unlike rate ± z·sqrt(rate(1-rate)/n)."""
    if n <= 0:
        return None
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (rate * (1 - rate) / n + z * z / (4 * n * n)) ** 0.5
    return [round(max(0.0, centre - half), 6), round(min(1.0, centre + half), 6)]



def unit(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= 1 else None


def products(conditional: list[float]) -> list[float]:
    """P(tokens 1..k all accepted) from the conditional rates."""
    out, running = [], 1.0
    for a in conditional:
        running *= a
        out.append(running)
    return out


def _ends(values: list[float], bounds: list[list[float] | None], high: list[bool], scale: float) -> list[float]:
    """Each value moved to its interval's high end where `high[k]`, else to its low end, `scale` of the way."""
    return [a + scale * ((b[1] if up else b[0]) - a) if b else a
            for a, b, up in zip(values, bounds, high, strict=False)]


def interval_ends(evidence: Evidence, trained: int, scale: float = 1.0) -> list[tuple[list[float], list[float] | None]]:
    """(conditional, step) acceptance at the ends of the evidence's intervals, `scale` of the way out from the
    measured rates (1: the interval's ends): [] where the evidence has no interval.

    Each position sits at an end of its own interval, in the patterns that push the gain furthest either way: the
    conditional rates all low, all high, high inside the trained depth and low beyond (a steeper fall: the most a
    retrain lifts), and the reverse; the step rates (with the step rule) at the fall's steepest and its flattest
    (u_T high, u_1 low where T > 1, low beyond; and the mirror). Every rate at an end at once is a band wider than
    90% jointly: a cannot_tell is where even that much doubt could not change the verdict, is not reported."""
    n = len(evidence.acceptance)
    inside = [k < trained for k in range(n)]
    patterns = [[False] * n, [True] * n, inside, [not x for x in inside]]
    conditional = ([_ends(evidence.acceptance, evidence.acceptance_interval, high, scale) for high in patterns]
                   if any(evidence.acceptance_interval) else [evidence.acceptance])
    steps: list[list[float] | None] = [evidence.step_acceptance or None]
    if evidence.step_acceptance and any(evidence.step_acceptance_interval):
        steep = [k < trained and (k > 0 or trained == 1) for k in range(n)]
        steps = [_ends(evidence.step_acceptance, evidence.step_acceptance_interval, high, scale)
                 for high in (steep, [not x for x in steep])]
    if len(conditional) == 1 and len(steps) == 1:
        return []
    return [(c, u) for c in conditional for u in steps]



def settle_text(evidence: Evidence, trained: int, verdict: str, verdict_on: Any) -> str:
    """What would settle a cannot_tell: the width (as a share of the interval's now) at which every end gives the
    measured rates' verdict, found by halving, and the rounds that take (a Wilson or bootstrap interval narrows as
    one over the root of its sample): about 1 / share^2 times as many."""
    agree, disagree = 0.0, 1.0
    for _ in range(7):
        share = (agree + disagree) / 2
        if all(verdict_on(c, u) == verdict for c, u in interval_ends(evidence, trained, share)):
            agree = share
        else:
            disagree = share
    times = 1 / max(agree, 1 / 128) ** 2
    more = f"about {times:.0f}x" if times < 1000 else "over 1000x"
    said = "restart" if verdict == "restart" else "keep going"
    if evidence.source == "simulation":
        return (f"the verdict at the measured rates ({said}) holds once the intervals are {agree:.0%} as wide: {more} "
                f"the {evidence.rounds[0] if evidence.rounds else 'present'} validation rounds (trainer.sim_samples, "
                "0 for the whole validation split), or an evaluation of the run (its eval_corpus, at the attempt's end)"
                ", which decides over the simulation")
    return (f"the verdict at the measured rates ({said}) holds once the intervals are {agree:.0%} as wide: an "
            f"evaluation over {more} the {evidence.prompts or 'present'} prompts (trainer.eval_samples)")



def said(evidence: Evidence, with_gain: bool = True) -> str:
    """The evidence as the summary's last clause: which, over how many rounds, the rule's rate, and the gain over
    its interval."""
    if evidence.source == "simulation":
        sizes = (f" over {evidence.rounds[0]} validation rounds, {evidence.rounds[-1]} reaching position "
                 f"{len(evidence.rounds)}" if evidence.rounds else "")
        what = f"simulation (sim_acc_k{sizes}, not yet checked against decoding"
    else:
        sizes = (f" over {evidence.prompts} prompts, {evidence.rounds[0]} rounds" if evidence.prompts and evidence.rounds
                 else "")
        what = f"decoding (attempt {evidence.attempt}'s evaluation{sizes} calibrating sim_acc_k per position"
    rule = ("the decay read from sim_step_acc_k" if evidence.decay_from == "sim_step_acc_k" else
            "the decay read from sim_acc_k: this run reports no sim_step_acc_k")
    spread = (f", the gain {evidence.gain_interval[0]:+.1%} to {evidence.gain_interval[1]:+.1%} over "
              f"{'decoding' if evidence.source == 'decoding' else 'the simulation'}'s 90% intervals"
              if evidence.gain_interval and with_gain else "")
    return f"evidence: {what}; {rule}{spread})"


STEP_NOTE = ("the retrain rule reads sim_step_acc_k (proposal k right over every round) for the decay past the "
             "trained depth: sim_acc_k there is taken over the rounds that survived k-1 proposals, the easy ones, so it "
             "climbs with depth by selection alone (survivor bias)")
FALLBACK_NOTE = ("this run reports no sim_step_acc_k (a trainer older than it): the retrain rule falls back to "
                 "reading the decay from sim_acc_k, whose rounds past the trained depth are the ones that survived k-1 "
                 "proposals (survivor bias), so a draft that falls past its TTT can read as holding up; a run of the "
                 "current trainer reports sim_step_acc_k")


def _step_rates(latest: dict[str, Any], n: int) -> tuple[list[float], list[list[float] | None]]:
    """sim_step_acc_1..n with their Wilson intervals over sim_scored_k, or ([], []) where not all reported."""
    step, scored = (indexed_values(latest, base, n) for base in (series.SIM_STEP_ACC, series.SIM_SCORED))
    if not (step and scored):
        return [], []
    return [min(1.0, a) for a in step], [wilson(min(1.0, a), r) for a, r in zip(step, scored, strict=True)]


def simulation_evidence(latest: dict[str, Any], accs: list[float]) -> Evidence:
    """The live simulation as evidence: sim_acc_k with its Wilson intervals over sim_rounds_k, and sim_step_acc_k
    (over every round: no survivor bias) with theirs over sim_scored_k, where the trainer reported them."""
    n = len(accs)
    rounds = indexed_values(latest, series.SIM_ROUNDS, n)
    evidence = Evidence(source="simulation", acceptance=accs, detail=(
        "simulation: the live sim_acc_k (teacher-forced chains on validation data, not decoding; no evaluation of "
        "this run to calibrate them yet: one comes with the end of an attempt, or --eval-every)"))
    if rounds:
        evidence.rounds = [int(r) for r in rounds]
        evidence.acceptance_interval = [wilson(a, r) for a, r in zip(accs, rounds, strict=True)]
    evidence.step_acceptance, evidence.step_acceptance_interval = _step_rates(latest, n)
    evidence.decay_from = "sim_step_acc_k" if evidence.step_acceptance else "sim_acc_k"
    evidence.decay_note = STEP_NOTE if evidence.step_acceptance else FALLBACK_NOTE
    evidence.interval = (f"Wilson {CONFIDENCE:.0%} over the rounds behind each rate (sim_rounds_k, sim_scored_k), "
                         "read as independent: rounds of one sequence are not, so the true spread is wider"
                         if rounds else "none: this run reports no sim_rounds_k (the rounds behind sim_acc_k)")
    return evidence


