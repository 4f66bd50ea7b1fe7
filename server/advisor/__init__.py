"""The depth advisor: expected tokens/s of speculative decoding per depth, for a given interconnect.

Plain arithmetic over an evaluation (see trainer/evaluate) and a per-round cost model; no torch, no database.

One speculation round at depth d (batch 1, the latency-bound regime speculation is used in):
    round_ms(d) = draft_round_ms + d * draft_step_ms  (d >= 1)      the draft proposes d tokens one by one
                + verifier_base_ms + verifier_per_token_ms*(d+1)  one verifier forward over d+1 tokens
                  (verifier_one_token_ms instead at d = 0, where measured: one token runs matrix-vector kernels)
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

The serving engine (server/advisor/engine.py): `sglang` runs the draft at the target's tp, so each draft forward
pays its all-reduces; `vllm` with draft_tp=1 replicates it; `measured` takes the round's cost as timed. With an
engine, every depth's answer carries its terms (verifier pass, draft forwards, all-reduces).

Rooms: tables (the measured data and defaults), cost (CostModel), engine (Drafting, EngineCost), depth (the algorithm), results (what it
answers, typed). The `longrun advise` command and GET /v1/runs/{id}/advice both call advise().
"""

from server.advisor.cost import CostModel
from server.advisor.depth import RETRAIN_ASSUMPTION, advise, compare_interconnects, improved_positions
from server.advisor.engine import ENGINES, Drafting, EngineCost, RoundTerms
from server.advisor.results import Advice, DepthSpeed, InterconnectComparison, NoSpeculation, RetrainAdvice
from server.advisor.tables import (
    INTERCONNECTS,
    NAMED_ALLREDUCE_TABLES,
    NVLINK_ALLREDUCE_US,
    PCIE_P2P_DISABLED_ALLREDUCE_US,
    load_allreduce_table,
    pcie_allreduce_us,
    pcie_extra_us_per_call,
)

__all__ = [
    "ENGINES", "Drafting", "EngineCost", "RoundTerms", "INTERCONNECTS", "NAMED_ALLREDUCE_TABLES", "NVLINK_ALLREDUCE_US", "PCIE_P2P_DISABLED_ALLREDUCE_US",
    "RETRAIN_ASSUMPTION", "Advice", "CostModel", "DepthSpeed", "InterconnectComparison", "NoSpeculation",
    "RetrainAdvice", "advise", "compare_interconnects", "improved_positions", "load_allreduce_table",
    "pcie_allreduce_us", "pcie_extra_us_per_call",
]
