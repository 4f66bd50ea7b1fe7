"""The per-round cost model of speculative decoding on one tensor-parallel group (see server/advisor)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import cached_property

from server.advisor.tables import (
    DEFAULT_DRAFT_STEP_MS,
    DEFAULT_DRAFT_VOCAB,
    DEFAULT_HBM_BYTES_PER_S,
    DEFAULT_HIDDEN,
    DEFAULT_KV_CONTEXT_TOKENS,
    DEFAULT_LAYERS,
    DEFAULT_VERIFIER_ONE_GPU_MS,
    DEFAULT_VERIFIER_PER_TOKEN_ONE_GPU_MS,
    Table,
    check_interconnect,
    default_allreduce_us,
)
from server.advisor.verifier import (
    BUILT_IN,
    Parallelism,
    VerifierCost,
    VerifierShape,
    draft_params,
    verifier_cost,
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
    allreduce_us: Table
    layers: int = DEFAULT_LAYERS
    hidden: int = DEFAULT_HIDDEN
    # the draft's fixed cost per round (its first step reads the tokens accepted last round), paid only when it
    # proposes: a decode without speculation runs no draft
    draft_round_ms: float = 0.0
    # a verifier forward over one token where measured: matrix-vector kernels make it cheaper than the line
    # through the larger token counts (measured on an H200: 1.81 ms against 1.95-2.02 ms for 2-17 tokens)
    verifier_one_token_ms: float | None = None
    allreduces_per_layer: int = 2  # Megatron-style TP: after attention and after the MLP
    bytes_per_value: int = 2  # bf16 activations
    # the verifier priced from its own config.json (server/advisor/verifier.py): its forward and collectives
    # replace verifier_base_ms / verifier_per_token_ms and layers x allreduces_per_layer
    verifier: VerifierCost | None = None
    # what each term rests on, "measured: ..." or "modelled: ..." (set by the builder; defaults filled in)
    basis: dict[str, str] = field(default_factory=dict)
    priced_verifier: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "priced_verifier", self.verifier.description if self.verifier else BUILT_IN)
        defaults = {
            "verifier_forward": (self.verifier.basis.get("verifier_forward", "modelled") if self.verifier else
                                 f"modelled: {self.verifier_base_ms:g} ms + {self.verifier_per_token_ms:g} ms per "
                                 "verified token (the built-in 70B-class default unless given)"),
            "verifier_collectives": (self.verifier.basis.get("verifier_collectives", "modelled") if self.verifier
                                     else f"{self.layers} layers x {self.allreduces_per_layer} all-reduces"),
            "draft_step": f"modelled: {self.draft_step_ms:g} ms of weight reads per draft forward",
        }
        object.__setattr__(self, "basis", {**defaults, **self.basis})
        for name in ("tp", "layers", "hidden", "allreduces_per_layer", "bytes_per_value"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in ("draft_step_ms", "verifier_base_ms", "verifier_per_token_ms", "draft_round_ms"):
            check_number(getattr(self, name), name, low=0.0)
        if self.verifier_one_token_ms is not None and check_number(
                self.verifier_one_token_ms, "verifier_one_token_ms", low=0.0) <= 0:
            raise ValueError("verifier_one_token_ms must be > 0: a verifier forward always takes time")
        if self.verifier_base_ms <= 0:
            raise ValueError("verifier_base_ms must be > 0: a verifier forward always takes time")
        table = tuple((int(b), float(us)) for b, us in self.allreduce_us)
        if not table:
            raise ValueError("allreduce_us is empty: give at least one (bytes, µs) measurement")
        for nbytes, us in table:
            if nbytes < 1:
                raise ValueError(f"allreduce_us: message size must be >= 1 byte, got {nbytes}")
            check_number(us, f"allreduce_us at {nbytes} bytes", low=0.0)
        object.__setattr__(self, "allreduce_us", table)

    @classmethod
    def for_interconnect(cls, name: str, tp: int, **overrides: object) -> CostModel:
        """The default 70B-class verifier on H200s, with the all-reduce table of `name`; any field overridable."""
        check_interconnect(name)
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

    @classmethod
    def for_verifier(cls, shape: VerifierShape, parallel: Parallelism, allreduce_us: Table,
                     measured: dict | None = None, context_tokens: int = DEFAULT_KV_CONTEXT_TOKENS,
                     draft_vocab: int = DEFAULT_DRAFT_VOCAB) -> CostModel:
        """The verifier of `shape` served at `parallel`, on this all-reduce table; its EAGLE-3 draft one decoder
        layer of the verifier's hidden size (modelled); `measured`: a stored probe-verifier answer."""
        cost = verifier_cost(shape, parallel, context_tokens=context_tokens, measured=measured)
        draft = draft_params(shape, draft_vocab)
        step = draft * 2 / DEFAULT_HBM_BYTES_PER_S * 1000
        return cls(tp=parallel.tp, draft_step_ms=step, verifier_base_ms=cost.fixed_ms or 1e-9,
                   verifier_per_token_ms=cost.per_token_ms, allreduce_us=allreduce_us, layers=shape.layers,
                   hidden=shape.hidden, verifier=cost,
                   basis={"draft_step": f"modelled: an EAGLE-3 draft layer of hidden {shape.hidden} with a "
                          f"{draft_vocab}-token head, {draft / 1e9:.3g}B bf16 parameters read per forward at "
                          f"{DEFAULT_HBM_BYTES_PER_S / 1e12:g} TB/s"})

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
        if depth == 0 and self.verifier_one_token_ms is not None:
            return self.verifier_one_token_ms
        if self.verifier is not None:
            return self.verifier.ms(depth + 1)
        return self.verifier_base_ms + self.verifier_per_token_ms * (depth + 1)

    @property
    def allreduce_calls(self) -> int:
        """The verifier's all-reduces per forward (0 at tp=1)."""
        if self.tp == 1:
            return 0
        return self.verifier.allreduce_calls if self.verifier else self.layers * self.allreduces_per_layer

    @property
    def alltoall_calls(self) -> int:
        return self.verifier.alltoall_calls if self.verifier and self.tp > 1 else 0

    def alltoall_ms(self, depth: int) -> float:
        """Expert-parallel dispatch + combine, each priced as one all-reduce call of its bytes (modelled)."""
        if not self.alltoall_calls:
            return 0.0
        message = (depth + 1) * self.verifier.alltoall_bytes_per_token
        return self.alltoall_calls * self.allreduce_latency_us(message) / 1000.0

    def allgather_latency_us(self, output_bytes: float) -> float:
        """One all-gather of `output_bytes` in all: a ring all-gather runs tp - 1 steps to an all-reduce's
        2 (tp - 1) over the same bytes, so half the all-reduce's time from the table (no all-gather table)."""
        return self.allreduce_latency_us(output_bytes) / 2

    def comm_ms(self, depth: int) -> float:
        if self.tp == 1:
            return 0.0
        message = (depth + 1) * self.hidden * self.bytes_per_value
        return self.allreduce_calls * self.allreduce_latency_us(message) / 1000.0 + self.alltoall_ms(depth)

    def round_ms(self, depth: int) -> float:
        draft_ms = self.draft_round_ms + depth * self.draft_step_ms if depth else 0.0
        return draft_ms + self.verifier_ms(depth) + self.comm_ms(depth)


def _lower_envelope(table: Table) -> list[tuple[int, float]]:
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


def check_number(value: object, what: str, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what} = {value} is outside [{low}, {high}]")
    return float(value)
