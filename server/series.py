"""The metric series the server fills itself, named here once: the attempt number, and each GPU's utilisation
and memory sampled from nvidia-smi. Every other series name is the job's own.

A GPU's series is `gpu_util_<i>` / `gpu_mem_<i>` for GPU i of the attempt's first node, `node<n>_gpu_util_<i>` for
node n past it. The client (longrun/views.py), the page (server/web/names.js) and the trainer's tracker tags
(trainer/trackers.py) cannot import the server and spell the pattern themselves; tests/test_shared_names.py fails
when one of them drifts from this one."""

import re
from enum import StrEnum

ATTEMPT = "attempt"


class GpuSeries(StrEnum):
    UTIL = "gpu_util"  # percent
    MEM = "gpu_mem"  # MiB used


GPU_SERIES = re.compile(r"^(?:node(?P<node>\d+)_)?(?P<kind>gpu_util|gpu_mem)_(?P<gpu>\d+)$")
# what a job may not write: its line would overwrite what the server measured
SERVER_SERIES = re.compile(rf"^(?:{ATTEMPT}|(?:node\d+_)?(?:gpu_util|gpu_mem)_\d+)$")


SERVER_SERIES_DOC = ("the job's own metric names, and the series the server measures itself: "
                     + " and ".join(f"`{kind}_<i>`" for kind in GpuSeries)
                     + f" for GPU i of the first node (`node<n>_` before them past it); `{ATTEMPT}` is reserved")


def gpu_series(kind: GpuSeries, gpu: int, node: int = 0) -> str:
    return f"{f'node{node}_' if node else ''}{kind}_{gpu}"
