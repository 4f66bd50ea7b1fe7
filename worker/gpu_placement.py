"""Which GPUs an attempt gets, whether it must wait, and what it is seen using: decisions over one
nvidia-smi snapshot (worker/gpus.py parses it; worker/protocol.py carries it)."""

from server.series import GpuSeries, gpu_series
from server.spec import RunCreate
from worker.gpus import foreign_gpu_holders, holders_message, pick_free_gpus
from worker.protocol import GpuView


class WaitForGpus(Exception):
    """The GPUs a run needs are held by processes that are not the run's."""


def visible_devices(env: dict[str, str]) -> list[int] | None:
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [int(x) for x in value.split(",") if x.strip().isdigit()]


def placement_env(spec: RunCreate, token: str, host_name: str, view: GpuView) -> dict[str, str]:
    """The job's environment with its GPUs chosen; raises WaitForGpus while others hold what it needs.

    A run that pins CUDA_VISIBLE_DEVICES needs those GPUs free; one that needs fewer GPUs than the host
    has gets the free ones; otherwise it needs every GPU. A host without GPUs runs the job on its CPUs."""
    env = dict(spec.env)
    snap = view.snapshot
    if not snap.available:
        return env
    ours = view.pids_of({token})
    wanted = visible_devices(env)
    need = spec.nproc_per_node
    if wanted is None and need < len(snap.gpus):
        picked = pick_free_gpus(snap, need, ours)
        if picked is None:
            held = foreign_gpu_holders(snap, ours, None)
            raise WaitForGpus(f"{need} free GPUs needed on {host_name}; {holders_message(held)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in picked)
        return env
    held = foreign_gpu_holders(snap, ours, wanted)
    if held:
        raise WaitForGpus(f"on {host_name}: {holders_message(held)}")
    return env


def gpu_readings(view: GpuView, token: str, assigned: list[int] | None, node_index: int = 0) -> dict[str, float]:
    """Utilisation and memory of the GPUs the attempt uses, as metric name -> value.

    The GPUs its processes hold; before they hold any, the ones it was given; else all of them."""
    if not view.snapshot.available:
        return {}
    ours = view.pids_of({token})
    used = {g.index for g in view.snapshot.gpus if any(p.pid in ours for p in g.processes)}
    used = used or set(assigned or [g.index for g in view.snapshot.gpus])
    readings = {}
    for g in view.snapshot.gpus:
        if g.index in used:
            if g.utilization_pct is not None:
                readings[gpu_series(GpuSeries.UTIL, g.index, node_index)] = float(g.utilization_pct)
            if g.memory_used_mib is not None:
                readings[gpu_series(GpuSeries.MEM, g.index, node_index)] = float(g.memory_used_mib)
    return readings


def gpu_holders(view: GpuView, token: str, pids: set[int]) -> list[int]:
    """Pids of the attempt still listed by nvidia-smi as holding GPU memory (none on a GPU-less host)."""
    return sorted({p.pid for g in view.snapshot.gpus for p in g.processes
                   if p.pid in pids or view.token_of.get(p.pid) == token})
