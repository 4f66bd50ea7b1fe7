"""The advisor's data: measured NCCL all-reduce tables, the PCIe estimate, and the default verifier's shape.

The two measured tables are tests/fixtures/h200x2/allreduce-*.json (a test keeps them equal).
"""

import json

Table = tuple[tuple[int, float], ...]

# NCCL all-reduce (bytes, µs) on two H200s, tests/fixtures/h200x2/allreduce-nvlink.json (NVLink NV18).
NVLINK_ALLREDUCE_US: Table = (
    (1024, 45.16), (4096, 41.03), (16384, 72.31), (65536, 38.58), (262144, 42.98),
    (1048576, 40.2), (4194304, 42.69), (16777216, 74.04), (67108864, 307.7),
)
# The same two GPUs with NCCL_P2P_DISABLE=1 (allreduce-p2p-disabled.json): traffic goes through host memory.
# Not a real PCIe switch, and not the default: at decode sizes it is no slower per call than NVLink but dearer per
# byte (bandwidth-bound), so it can favour shallower depths. Optional, as table "pcie-p2p-disabled".
PCIE_P2P_DISABLED_ALLREDUCE_US: Table = (
    (1024, 36.92), (4096, 47.27), (16384, 35.82), (65536, 37.72), (262144, 68.97),
    (1048576, 62.05), (4194304, 166.75), (16777216, 627.45), (67108864, 2376.73),
)
# Excess latency of one PCIe all-reduce call over NVLink, per ring step: nccl-tests small-message all_reduce on
# 8-GPU PCIe Gen4/Gen5 servers without NVLink is commonly reported at ~50-100 µs vs ~15-25 µs on NVSwitch systems,
# an excess of ~25-85 µs over the 2*(8-1) = 14 ring steps; taken conservatively as 3 µs per step (42 µs at tp=8).
PCIE_US_PER_RING_STEP = 3.0

# The interconnects compared by default; "pcie" depends on tp, so its table is built per call.
INTERCONNECTS = ("nvlink", "pcie")
# Tables that can be named instead of given (`longrun advise --allreduce-table NAME`, or allreduce_us=...).
NAMED_ALLREDUCE_TABLES = {"nvlink": NVLINK_ALLREDUCE_US, "pcie-p2p-disabled": PCIE_P2P_DISABLED_ALLREDUCE_US}

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
# the draft's head: EAGLE-3's reduced vocabulary
DEFAULT_DRAFT_VOCAB = 32000
# The bandwidth and compute those defaults rest on, for a verifier priced from its own config.json
# (server/advisor/verifier.py): 140 GB in 40 ms, 140 GFLOP in 0.3 ms.
DEFAULT_HBM_BYTES_PER_S = 3.5e12
DEFAULT_TFLOPS = 2 * 70e9 / 0.3e-3 / 1e12
# the context whose KV cache each decode forward reads, where the deployment does not say
DEFAULT_KV_CONTEXT_TOKENS = 4096


def pcie_extra_us_per_call(tp: int) -> float:
    """Fixed excess µs of one PCIe all-reduce over NVLink: PCIE_US_PER_RING_STEP per ring step, 2*(tp-1) steps."""
    return PCIE_US_PER_RING_STEP * 2 * (tp - 1)


def pcie_allreduce_us(tp: int) -> Table:
    """The default PCIe table at tp: the NVLink measurement plus pcie_extra_us_per_call(tp) at every size."""
    extra = pcie_extra_us_per_call(tp)
    return tuple((nbytes, us + extra) for nbytes, us in NVLINK_ALLREDUCE_US)


def check_interconnect(name: str) -> None:
    if name not in INTERCONNECTS:
        raise ValueError(f"unknown interconnect {name!r}: expected one of {', '.join(INTERCONNECTS)}")


def default_allreduce_us(interconnect: str, tp: int) -> Table:
    check_interconnect(interconnect)
    return NVLINK_ALLREDUCE_US if interconnect == "nvlink" else pcie_allreduce_us(tp)


def load_allreduce_table(path: str) -> Table:
    """A named table (NAMED_ALLREDUCE_TABLES) or a JSON file of measurements like the fixtures'."""
    if path in NAMED_ALLREDUCE_TABLES:
        return NAMED_ALLREDUCE_TABLES[path]
    with open(path) as f:
        data = json.load(f)
    rows = data.get("allreduce") if isinstance(data, dict) else data
    try:
        return tuple((int(row["bytes"]), float(row["us"])) for row in rows)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: expected {{\"allreduce\": [{{\"bytes\": N, \"us\": T}}, ...]}}") from None
