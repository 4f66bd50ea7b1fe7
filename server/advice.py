"""The depth advisor: expected tokens/s of speculative decoding per depth, for a given interconnect.

Plain arithmetic over an evaluation (see trainer/evaluate) and a per-round cost model; no torch, no database.

One speculation round at depth d (batch 1, the latency-bound regime speculation is used in):
    round_ms(d) = d * draft_step_ms                               the draft proposes d tokens one by one
                + verifier_base_ms + verifier_per_token_ms*(d+1)  one verifier forward over d+1 tokens
                + comm_ms(d)                                      its tensor-parallel all-reduces
    comm_ms(d)  = layers * allreduces_per_layer * allreduce_latency((d+1) * hidden * bytes_per_value)  if tp > 1
    tokens/s(d) = 1000 * tau_d / round_ms(d),  tau_d = mean tokens accepted per round (1 + sum of a_i, i <= d)

The draft is taken to run replicated on every tensor-parallel rank (one decoder layer: small enough), so it
pays no collective of its own; if yours is sharded, fold its all-reduces into draft_step_ms.

Which depth a slower interconnect favours: depth d' beats d when tau_d'/tau_d > round_ms(d')/round_ms(d).
A cost model whose rounds cost a fixed amount more (an interconnect with a higher per-call latency) has a
smaller ratio on the right for every d < d', so it never prefers a shallower depth; with ties broken towards
the shallower depth in both, that stays true. It does not hold for an interconnect whose extra cost grows with
the tokens verified faster than the round cost does (bandwidth-bound rather than latency-bound): see
compare_interconnects' note, and tests/server/test_advice.py for the proof as a test.

The default PCIe cost is built to be the first kind: the NVLink measurement plus a fixed excess per all-reduce
call, pcie_extra_us_per_call(tp) = PCIE_US_PER_RING_STEP * 2*(tp-1) (42 µs at tp=8). Decode messages are small
((d+1) * hidden * 2 bytes: 16 KiB per verified token for a 70B-class model), so their all-reduce time is
latency, not bandwidth: a PCIe-only box pays more per call (ring/tree steps through PCIe switches and host
bridges), not more per byte. With that default the advisor never recommends a shallower depth for PCIe than
for NVLink, at any tp. The NCCL_P2P_DISABLE=1 measurement (bandwidth-bound: no slower per call, dearer per
byte) stays available as the optional table "pcie-p2p-disabled"; it can make PCIe shallower, and
compare_interconnects says so when it does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, fields
from functools import cached_property

# NCCL all-reduce (bytes, µs) on two H200s, tests/fixtures/h200x2/allreduce-nvlink.json (NVLink NV18).
NVLINK_ALLREDUCE_US: tuple[tuple[int, float], ...] = (
    (1024, 45.16), (4096, 41.03), (16384, 72.31), (65536, 38.58), (262144, 42.98),
    (1048576, 40.2), (4194304, 42.69), (16777216, 74.04), (67108864, 307.7),
)
# The same two GPUs with NCCL_P2P_DISABLE=1 (allreduce-p2p-disabled.json): traffic goes through host memory.
# Not a real PCIe switch, and not the default: at decode sizes it is no slower per call than NVLink but dearer per
# byte (bandwidth-bound), so it can favour shallower depths. Optional, as table "pcie-p2p-disabled".
PCIE_P2P_DISABLED_ALLREDUCE_US: tuple[tuple[int, float], ...] = (
    (1024, 36.92), (4096, 47.27), (16384, 35.82), (65536, 37.72), (262144, 68.97),
    (1048576, 62.05), (4194304, 166.75), (16777216, 627.45), (67108864, 2376.73),
)
# Excess latency of one PCIe all-reduce call over NVLink, per ring step: nccl-tests small-message all_reduce on
# 8-GPU PCIe Gen4/Gen5 servers without NVLink is commonly reported at ~50-100 µs vs ~15-25 µs on NVSwitch systems,
# an excess of ~25-85 µs over the 2*(8-1) = 14 ring steps; taken conservatively as 3 µs per step (42 µs at tp=8).
PCIE_US_PER_RING_STEP = 3.0


def pcie_extra_us_per_call(tp: int) -> float:
    """Fixed excess µs of one PCIe all-reduce over NVLink: PCIE_US_PER_RING_STEP per ring step, 2*(tp-1) steps."""
    return PCIE_US_PER_RING_STEP * 2 * (tp - 1)


PCIE_EXTRA_US_PER_CALL = pcie_extra_us_per_call(8)  # 42 µs at the default tp=8


def pcie_allreduce_us(tp: int) -> tuple[tuple[int, float], ...]:
    """The default PCIe table at tp: the NVLink measurement plus pcie_extra_us_per_call(tp) at every size."""
    extra = pcie_extra_us_per_call(tp)
    return tuple((nbytes, us + extra) for nbytes, us in NVLINK_ALLREDUCE_US)


# The interconnects compared by default; "pcie" depends on tp, so it is built per call.
INTERCONNECTS = ("nvlink", "pcie")
# Tables that can be named instead of given (advise_main's --allreduce-table NAME, or allreduce_us=...).
NAMED_ALLREDUCE_TABLES = {"nvlink": NVLINK_ALLREDUCE_US, "pcie-p2p-disabled": PCIE_P2P_DISABLED_ALLREDUCE_US}


def default_allreduce_us(interconnect: str, tp: int) -> tuple[tuple[int, float], ...]:
    _check_interconnect(interconnect)
    return NVLINK_ALLREDUCE_US if interconnect == "nvlink" else pcie_allreduce_us(tp)

# Default verifier: a 70B-class dense model in bf16 (Llama-3-70B shapes).
DEFAULT_LAYERS = 80
DEFAULT_HIDDEN = 8192
# A batch-1 forward reads all 140 GB of weights; at ~3.5 TB/s effective H200 bandwidth that is 40 ms on one
# GPU's worth of bandwidth, split over tp ranks.
DEFAULT_VERIFIER_ONE_GPU_MS = 40.0
# Each extra verified token is ~140 GFLOP (2 x 70e9); at ~470 TFLOP/s effective bf16 that is 0.3 ms, split over tp.
DEFAULT_VERIFIER_PER_TOKEN_ONE_GPU_MS = 0.3
# EAGLE-3 draft of that verifier: one 8192-wide decoder layer plus a 32k-token head, ~1.2 B params (2.4 GB)
# read per proposed token at ~4 TB/s.
DEFAULT_DRAFT_STEP_MS = 0.6

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


@dataclass(frozen=True)
class CostModel:
    """Per-round cost of speculative decoding on one tensor-parallel group. Times in ms, table in (bytes, µs).

    allreduce_us is one all-reduce call's time by message size at the serving tp. The NVLink default is a 2-rank
    measurement used as-is for any tp > 1 (at these message sizes, over NVSwitch, the call time is mostly fixed
    overhead); the PCIe default adds pcie_extra_us_per_call(tp), which grows with the ring's 2*(tp-1) steps.
    """

    tp: int
    draft_step_ms: float
    verifier_base_ms: float
    verifier_per_token_ms: float
    allreduce_us: tuple[tuple[int, float], ...]
    layers: int = DEFAULT_LAYERS
    hidden: int = DEFAULT_HIDDEN
    allreduces_per_layer: int = 2  # Megatron-style TP: after attention and after the MLP
    bytes_per_value: int = 2  # bf16 activations

    def __post_init__(self) -> None:
        for name in ("tp", "layers", "hidden", "allreduces_per_layer", "bytes_per_value"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("draft_step_ms", "verifier_base_ms", "verifier_per_token_ms"):
            _check_number(getattr(self, name), name, low=0.0)
        if self.verifier_base_ms <= 0:
            raise ValueError("verifier_base_ms must be > 0: a verifier forward always takes time")
        table = tuple((int(b), float(us)) for b, us in self.allreduce_us)
        if not table:
            raise ValueError("allreduce_us is empty: give at least one (bytes, µs) measurement")
        for nbytes, us in table:
            if nbytes < 1:
                raise ValueError(f"allreduce_us: message size must be >= 1 byte, got {nbytes}")
            _check_number(us, f"allreduce_us at {nbytes} bytes", low=0.0)
        object.__setattr__(self, "allreduce_us", table)

    @classmethod
    def for_interconnect(cls, name: str, tp: int, **overrides: object) -> CostModel:
        """The default 70B-class verifier on H200s, with the all-reduce table of `name`; any field overridable."""
        _check_interconnect(name)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a whole number >= 1, got {tp!r}")
        known = {f.name for f in fields(cls)} - {"tp"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown cost model field(s) {unknown}; known: {sorted(known)}")
        defaults = {
            "draft_step_ms": DEFAULT_DRAFT_STEP_MS,
            "verifier_base_ms": DEFAULT_VERIFIER_ONE_GPU_MS / tp,
            "verifier_per_token_ms": DEFAULT_VERIFIER_PER_TOKEN_ONE_GPU_MS / tp,
            "allreduce_us": default_allreduce_us(name, tp),
        }
        return cls(tp=tp, **{**defaults, **overrides})

    @cached_property
    def _envelope(self) -> list[tuple[int, float]]:
        return _lower_envelope(self.allreduce_us)

    def allreduce_latency_us(self, nbytes: float) -> float:
        """One call's time for a message of nbytes, linear between measured sizes and beyond the largest."""
        table = self._envelope
        if len(table) == 1 or nbytes <= table[0][0]:
            return table[0][1]
        for (b0, u0), (b1, u1) in zip(table, table[1:], strict=False):
            if nbytes <= b1:
                return u0 + (nbytes - b0) * (u1 - u0) / (b1 - b0)
        (b0, u0), (b1, u1) = table[-2], table[-1]
        return u1 + (nbytes - b1) * (u1 - u0) / (b1 - b0)

    def verifier_ms(self, depth: int) -> float:
        return self.verifier_base_ms + self.verifier_per_token_ms * (depth + 1)

    def comm_ms(self, depth: int) -> float:
        if self.tp == 1:
            return 0.0
        message = (depth + 1) * self.hidden * self.bytes_per_value
        return self.layers * self.allreduces_per_layer * self.allreduce_latency_us(message) / 1000.0

    def round_ms(self, depth: int) -> float:
        return depth * self.draft_step_ms + self.verifier_ms(depth) + self.comm_ms(depth)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["allreduce_us"] = [list(row) for row in self.allreduce_us]
        return data


def _lower_envelope(table: tuple[tuple[int, float], ...]) -> list[tuple[int, float]]:
    """Each size's time as the least measured at that size or any larger one.

    Timing noise only ever adds time and a larger message never takes less, so a dip at a larger size bounds
    the smaller ones; this also keeps round cost non-decreasing in depth, which the depth comparison relies on.
    """
    best: dict[int, float] = {}
    for nbytes, us in table:
        best[nbytes] = min(us, best.get(nbytes, math.inf))
    envelope: list[tuple[int, float]] = []
    floor = math.inf
    for nbytes in sorted(best, reverse=True):
        floor = min(floor, best[nbytes])
        envelope.append((nbytes, floor))
    return envelope[::-1]


def _check_number(value: object, what: str, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what} = {value} is outside [{low}, {high}]")
    return float(value)


def _check_interconnect(name: str) -> None:
    if name not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect {name!r}: expected one of {', '.join(INTERCONNECTS)}")


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
        positions.append(_check_number(a, f"position_acceptance[{i}] (P(tokens 1..{i + 1} all accepted))", 0, 1))
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
        taus[depth] = _check_number(row["mean_accepted"], f"by_depth mean_accepted at depth {depth}", 1, depth + 1)
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
    _check_interconnect(interconnect)
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
) -> dict:
    """Expected tokens/s per depth, the depth to serve (0: do not speculate) and whether a deeper TTT pays off."""
    taus, positions = _read_evaluation(evaluation)
    cost = _cost_for(interconnect, tp, cost)
    _check_number(min_gain, "min_gain", low=0.0)
    by_depth = [
        {"depth": d, "mean_accepted": tau, "round_ms": cost.round_ms(d), "tokens_per_second": 1000 * tau / cost.round_ms(d)}
        for d, tau in sorted(taus.items())
    ]
    plain = 1000 / cost.round_ms(0)
    speeds = {0: plain, **{row["depth"]: row["tokens_per_second"] for row in by_depth}}
    depth = _shallowest_best(speeds)
    return {
        "interconnect": interconnect,
        "tp": tp,
        "recommended_depth": depth,
        "tokens_per_second": speeds[depth],
        "speedup_vs_no_speculation": speeds[depth] / plain,
        "no_speculation": {"round_ms": cost.round_ms(0), "tokens_per_second": plain},
        "by_depth": by_depth,
        "allreduce_basis": _allreduce_basis(cost),
        "retrain": _retrain_advice(
            cost, taus, positions, depth, speeds[depth], trained_ttt, retrain_seconds_by_ttt, min_gain
        ),
        "cost_model": cost.to_dict(),
    }


def improved_positions(positions: list[float], trained_ttt: int) -> list[float]:
    """Acceptance per position expected after training with a deeper TTT, under RETRAIN_ASSUMPTION."""
    t = trained_ttt
    if t >= len(positions):
        return list(positions)
    if t == 1:
        ratio = positions[0]
    else:
        ratio = (positions[t - 1] / positions[0]) ** (1 / (t - 1)) if positions[0] > 0 else 0.0
    return positions[:t] + [max(a, positions[t - 1] * ratio**k) for k, a in enumerate(positions[t:], start=1)]


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
    cost: CostModel,
    taus: dict[int, float],
    positions: list[float],
    depth_now: int,
    tps_now: float,
    trained_ttt: int | None,
    retrain_seconds_by_ttt: dict[int, float] | None,
    min_gain: float,
) -> dict:
    block: dict = {
        "trained_ttt": trained_ttt,
        "suggested_ttt_steps": None,
        "depth_after": None,
        "tokens_per_second_now": tps_now,
        "tokens_per_second_after": None,
        "gain": None,
        "predicted_training_seconds": None,
        "training_seconds_basis": None,
        "break_even_tokens": None,
        "pays_off": False,
        "reason": "",
        "assumption": RETRAIN_ASSUMPTION,
    }
    if trained_ttt is None:
        block["reason"] = "the draft's trained TTT depth is unknown; give trained_ttt to judge a deeper retrain"
        return block
    if isinstance(trained_ttt, bool) or not isinstance(trained_ttt, int) or trained_ttt < 1:
        raise ValueError(f"trained_ttt must be a whole number >= 1, got {trained_ttt!r}")
    if trained_ttt >= max(taus):
        block["reason"] = (
            f"the evaluation stops at depth {max(taus)}, within the trained TTT depth {trained_ttt}: "
            "evaluate deeper (--max-depth) to judge a deeper TTT"
        )
        return block

    better = improved_positions(positions, trained_ttt)
    # Only the improvement is added, so a measured tau keeps its own value at and below the trained depth.
    taus_after = {d: tau + sum(better[:d]) - sum(positions[:d]) for d, tau in taus.items()}
    speeds_after = {0: 1000 / cost.round_ms(0), **{d: 1000 * tau / cost.round_ms(d) for d, tau in taus_after.items()}}
    depth_after = _shallowest_best(speeds_after)
    tps_after = speeds_after[depth_after]
    block.update(depth_after=depth_after, tokens_per_second_after=tps_after, gain=tps_after / tps_now - 1)
    if depth_after <= trained_ttt:
        block["reason"] = (
            f"even with better acceptance beyond position {trained_ttt}, depth {depth_after} stays the fastest, "
            f"within the trained TTT depth {trained_ttt}: a deeper TTT would not speed up serving"
        )
        return block

    seconds, basis = _training_seconds(depth_after, retrain_seconds_by_ttt)
    gain = block["gain"]
    block.update(suggested_ttt_steps=depth_after, predicted_training_seconds=seconds, training_seconds_basis=basis)
    change = (
        f"serving at depth {depth_after} after a TTT-{depth_after} retrain is expected to give "
        f"{tps_after:.1f} tokens/s instead of {tps_now:.1f} at depth {depth_now} now ({gain:+.1%})"
    )
    if gain < min_gain:
        block["reason"] = f"{change}, below the {min_gain:.0%} worth a retrain"
        return block
    block["pays_off"] = True
    if seconds is None:
        block["reason"] = f"{change}; training time unknown (give retrain_seconds_by_ttt to weigh it)"
        return block
    # Serving N tokens saves N * (1/now - 1/after) seconds; break-even when that equals the training time.
    block["break_even_tokens"] = seconds / (1 / tps_now - 1 / tps_after)
    hours = block["break_even_tokens"] / tps_after / 3600
    block["reason"] = (
        f"{change}; the {seconds:.0f} s of training is won back after {block['break_even_tokens']:.3g} generated "
        f"tokens (~{hours:.3g} h of serving on one group)"
    )
    return block


def compare_interconnects(
    evaluation: dict,
    tp: int,
    trained_ttt: int | None = None,
    retrain_seconds_by_ttt: dict[int, float] | None = None,
    min_gain: float = 0.02,
    costs: dict[str, CostModel] | None = None,
    **overrides: object,
) -> dict:
    """advise() for every interconnect with the same measurements; overrides apply to each default cost model."""
    if costs is not None and overrides:
        raise ValueError("give either cost models or overrides, not both")
    advice = {}
    for name in INTERCONNECTS:
        cost = costs[name] if costs is not None else CostModel.for_interconnect(name, tp, **overrides)
        advice[name] = advise(evaluation, name, tp, cost, trained_ttt, retrain_seconds_by_ttt, min_gain)
    result: dict = {
        "tp": tp,
        "recommended_depth": {name: advice[name]["recommended_depth"] for name in INTERCONNECTS},
        **advice,
        "note": None,
    }
    if advice["pcie"]["recommended_depth"] < advice["nvlink"]["recommended_depth"]:
        result["note"] = (
            "PCIe gets a shallower depth than NVLink here: with these all-reduce tables its extra cost per call is "
            "not a fixed latency but grows with the tokens verified per round (bandwidth-bound), so deeper rounds "
            "cost it proportionally more."
        )
        if advice["pcie"]["cost_model"]["allreduce_us"] == [list(row) for row in PCIE_P2P_DISABLED_ALLREDUCE_US]:
            result["note"] += (
                " The pcie-p2p-disabled table is NVLink switched off on an NVLink box, so its small-message time "
                "matches NVLink's; a real PCIe box pays a larger fixed latency per call, which favours deeper "
                "speculation (the default PCIe estimate)."
            )
    return result


def _load_allreduce_table(path: str) -> tuple[tuple[int, float], ...]:
    """A named table (NAMED_ALLREDUCE_TABLES) or a JSON file of measurements."""
    if path in NAMED_ALLREDUCE_TABLES:
        return NAMED_ALLREDUCE_TABLES[path]
    with open(path) as f:
        data = json.load(f)
    rows = data.get("allreduce") if isinstance(data, dict) else data
    try:
        return tuple((int(row["bytes"]), float(row["us"])) for row in rows)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: expected {{\"allreduce\": [{{\"bytes\": N, \"us\": T}}, ...]}}") from None


def advise_main(argv: list[str]) -> int:
    """`longrun advise`: print depth advice for an evaluation file as JSON."""
    parser = argparse.ArgumentParser(
        prog="longrun advise",
        description="Expected tokens/s per speculation depth, the depth to serve, and whether a deeper TTT "
        "retrain pays off. Defaults: a 70B-class verifier (80 layers, hidden 8192) on H200s; "
        "PCIe is the NVLink all-reduce table plus 3 µs per ring step per call (2*(tp-1) steps).",
    )
    parser.add_argument("--evaluation", required=True, help="JSON from `python -m trainer.evaluate`")
    parser.add_argument("--interconnect", choices=[*INTERCONNECTS, "both"], default="both")
    parser.add_argument("--tp", type=int, default=8, help="tensor-parallel degree of the verifier (default 8)")
    parser.add_argument("--draft-ms", type=float, help="draft time per proposed token, ms")
    parser.add_argument("--verifier-ms", type=float, help="verifier forward per round without communication, ms")
    parser.add_argument("--verifier-per-token-ms", type=float, help="extra verifier time per verified token, ms")
    parser.add_argument("--layers", type=int, help="verifier layers")
    parser.add_argument("--hidden", type=int, help="verifier hidden size")
    parser.add_argument(
        "--allreduce-table", metavar="FILE|NAME",
        help="all-reduce times, JSON like tests/fixtures/h200x2/allreduce-*.json, or a named table: "
        + ", ".join(NAMED_ALLREDUCE_TABLES),
    )
    parser.add_argument("--trained-ttt", type=int, help="TTT steps the draft was trained with")
    parser.add_argument(
        "--retrain-seconds", action="append", default=[], metavar="TTT=SECONDS",
        help="predicted training time for a TTT depth (repeatable), e.g. 5=5400",
    )
    parser.add_argument("--min-gain", type=float, default=0.02, help="least speed-up worth a retrain (default 0.02)")
    args = parser.parse_args(argv)

    overrides: dict[str, object] = {
        field: value
        for field, value in (
            ("draft_step_ms", args.draft_ms),
            ("verifier_base_ms", args.verifier_ms),
            ("verifier_per_token_ms", args.verifier_per_token_ms),
            ("layers", args.layers),
            ("hidden", args.hidden),
        )
        if value is not None
    }
    try:
        with open(args.evaluation) as f:
            try:
                evaluation = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.evaluation} is not JSON: {exc}") from None
        if args.allreduce_table:
            if args.interconnect == "both":
                parser.error("--allreduce-table is one interconnect's table: pick --interconnect pcie or nvlink")
            overrides["allreduce_us"] = _load_allreduce_table(args.allreduce_table)
        seconds = {}
        for item in args.retrain_seconds:
            ttt, _, value = item.partition("=")
            try:
                seconds[int(ttt)] = float(value)
            except ValueError:
                raise ValueError(f"--retrain-seconds wants TTT=SECONDS, e.g. 5=5400; got {item!r}") from None
        if args.interconnect == "both":
            result = compare_interconnects(evaluation, args.tp, args.trained_ttt, seconds or None, args.min_gain,
                                           **overrides)
        else:
            cost = CostModel.for_interconnect(args.interconnect, args.tp, **overrides)
            result = advise(evaluation, args.interconnect, args.tp, cost, args.trained_ttt, seconds or None,
                            args.min_gain)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
