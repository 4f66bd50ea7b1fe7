"""The `gpus` and `interconnect` verbs: nvidia-smi's answers as they are (the worker parses them, as untrusted
input), who owns each GPU process, and the NCCL all-reduce sweep. The agent owns these command lines: a request
names only the tokens, ranks and sizes it asks about. `install_script` and `captured` are shared with the
`verifier` verb (verifier.py): a probe script the worker sends, installed content-addressed, and its bounded output."""

import os
import shlex
import subprocess
import sys

from .containment import node_members
from .files import workspace_moved, write_atomic
from .procfs import token_carriers, user_of

QUERY_GPU_CMD = [
    "nvidia-smi",
    "--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total",
    "--format=csv,noheader,nounits",
]
QUERY_APPS_CMD = [
    "nvidia-smi",
    "--query-compute-apps=pid,gpu_uuid,used_memory,process_name",
    "--format=csv,noheader,nounits",
]
TOPO_CMD = ["nvidia-smi", "topo", "-m"]
# a command replacing the bundled all-reduce sweep on this host (same arguments, same JSON line)
SWEEP_VAR = "LONGRUN_ALLREDUCE_SWEEP"
# the most of a probe command's output handed back: the worker parses it as untrusted input anyway
PROBE_OUTPUT_LIMIT = 256 << 10


def gpus(req):
    """Raw nvidia-smi answers (parsed by the worker), plus who owns each GPU process."""
    out = {}
    for key, cmd in (("gpu", QUERY_GPU_CMD), ("apps", QUERY_APPS_CMD)):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=30)
            out[key] = {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
        except FileNotFoundError as exc:
            out[key] = {"rc": 127, "stdout": "", "stderr": str(exc)}
        except subprocess.TimeoutExpired:
            out[key] = {"rc": 124, "stdout": "", "stderr": "nvidia-smi timed out"}
    owners = {}
    tokens = {t: set(pids) for t, pids in token_carriers(req.get("tokens", [])).items()}
    # any process of an attempt's containment is the attempt's, with or without the token in its environment
    for token, d in (req.get("dirs") or {}).items():
        if token in tokens:
            tokens[token] |= node_members(d, token)
    for line in out["apps"]["stdout"].splitlines():
        first = line.split(",")[0].strip()
        if first.isdigit():
            pid = int(first)
            owners[pid] = {"user": user_of(pid),
                           "token": next((t for t, pids in tokens.items() if pid in pids), None)}
    out["owners"] = owners
    return out


def captured(argv, timeout):
    """A command's exit status and (bounded) output; 127 when it cannot start, 124 when it ran out of time."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except OSError as exc:
        return {"rc": 127, "stdout": "", "stderr": str(exc)}
    except subprocess.TimeoutExpired:
        return {"rc": 124, "stdout": "", "stderr": f"{argv[0]} did not finish within {timeout:g}s"}
    return {"rc": p.returncode, "stdout": p.stdout[-PROBE_OUTPUT_LIMIT:], "stderr": p.stderr[-PROBE_OUTPUT_LIMIT:]}


def install_script(req, path, source):
    """Write a probe script where the worker named it (content-addressed under the workspace's .longrun/bin), once;
    why not, with nothing written, when the workspace or `path` no longer leads inside the workspace as registered
    (None when installed)."""
    moved = workspace_moved(req, os.path.dirname(path))
    if moved is not None:
        return moved
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, source)
    return None


def interconnect(req):
    """`nvidia-smi topo -m` and the NCCL all-reduce sweep at tp ranks, both raw (the worker parses them)."""
    topo = captured(TOPO_CMD, 30)
    override = os.environ.get(SWEEP_VAR)
    if override:
        argv = shlex.split(override)
    else:
        refused = install_script(req, req["sweep_path"], req["sweep_source"])
        if refused is not None:
            return {"error": f"interconnect: {refused}"}
        argv = [sys.executable, req["sweep_path"]]
    argv += ["--tp", "all" if req["tp"] == "all" else str(int(req["tp"]))]
    if req.get("sizes"):
        argv += ["--sizes", ",".join(str(int(n)) for n in req["sizes"])]
    return {"topo": topo, "sweep": captured(argv, float(req.get("timeout", 600)))}
