"""Reading nvidia-smi: GPU snapshots, who holds a GPU, and free GPUs for a run.

Everything here is parsing and decisions over text; the transport that runs the commands lives elsewhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# the host agent runs these itself (its `gpus` verb): the worker reads their output
from worker.hostside.gpus import QUERY_APPS_CMD, QUERY_GPU_CMD  # noqa: F401 (what the parsers read)

# Some drivers print this sentence instead of an empty CSV when no process uses a GPU.
_NO_PROCESSES = "no running processes found"


@dataclass
class GpuProcess:
    pid: int
    gpu_index: int
    used_memory_mib: int | None
    process_name: str
    user: str | None = None


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str
    utilization_pct: int | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    processes: list[GpuProcess] = field(default_factory=list)


@dataclass
class GpuSnapshot:
    gpus: list[Gpu]
    available: bool
    message: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _optional_int(value: str, what: str) -> int | None:
    """nvidia-smi writes "[N/A]", "[Not Supported]", "[Insufficient Permissions]" where it has no number."""
    value = value.strip()
    if not value or (value.startswith("[") and value.endswith("]")) or value.upper() in ("N/A", "NA"):
        return None
    try:
        return int(float(value))
    except ValueError:
        raise ValueError(f"{what}: expected a number, got {value!r}") from None


def _data_lines(csv_text: str) -> list[str]:
    lines = [line.strip() for line in csv_text.splitlines()]
    return [line for line in lines if line and line.lower() != _NO_PROCESSES]


def _parse_gpu_line(line: str) -> Gpu:
    # The name sits between two fields on each side, so a comma inside it cannot shift the numbers.
    head = line.split(",", 2)
    tail = head[-1].rsplit(",", 3) if len(head) == 3 else []
    if len(tail) != 4:
        raise ValueError(f"nvidia-smi GPU line has fewer than 6 fields: {line!r}")
    index = _optional_int(head[0], "GPU index")
    if index is None:
        raise ValueError(f"nvidia-smi GPU line has no index: {line!r}")
    return Gpu(
        index=index,
        uuid=head[1].strip(),
        name=tail[0].strip(),
        utilization_pct=_optional_int(tail[1], f"GPU {index} utilization"),
        memory_used_mib=_optional_int(tail[2], f"GPU {index} memory.used"),
        memory_total_mib=_optional_int(tail[3], f"GPU {index} memory.total"),
    )


def parse_gpus(query_gpu_csv: str, compute_apps_csv: str) -> list[Gpu]:
    """The GPUs of QUERY_GPU_CMD's output, each with its processes from QUERY_APPS_CMD's output, by index."""
    gpus = sorted((_parse_gpu_line(line) for line in _data_lines(query_gpu_csv)), key=lambda g: g.index)
    by_uuid = {gpu.uuid: gpu for gpu in gpus}
    for line in _data_lines(compute_apps_csv):
        # process_name is last and may itself contain commas, so split at most three times.
        fields = line.split(",", 3)
        if len(fields) != 4:
            raise ValueError(f"nvidia-smi process line has fewer than 4 fields: {line!r}")
        pid = _optional_int(fields[0], "process pid")
        gpu = by_uuid.get(fields[1].strip())
        # A process without a pid (hidden by the driver) or on a GPU not listed cannot be attributed.
        if pid is None or gpu is None:
            continue
        gpu.processes.append(
            GpuProcess(
                pid=pid,
                gpu_index=gpu.index,
                used_memory_mib=_optional_int(fields[2], f"pid {pid} used_memory"),
                process_name=fields[3].strip(),
            )
        )
    return gpus


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def snapshot_from_outputs(
    rc: int, stdout_gpu: str, stdout_apps: str, stderr: str, *, apps_rc: int = 0
) -> GpuSnapshot:
    """A snapshot from the two nvidia-smi queries, or an unavailable one that says why in a user's words.

    rc is QUERY_GPU_CMD's exit status; apps_rc is QUERY_APPS_CMD's when the two ran separately.
    """
    said = "\n".join((stdout_gpu, stdout_apps, stderr))
    lowered = said.lower()
    if rc == 127 or "command not found" in lowered or "nvidia-smi: not found" in lowered:
        return GpuSnapshot([], False, "This host has no usable GPU: nvidia-smi is not installed, so no NVIDIA "
                                      "driver is present. Install the driver, or run this on a GPU host.")
    if "nvidia-smi has failed" in lowered:
        return GpuSnapshot([], False, "This host has no usable GPU right now: the NVIDIA driver is not loaded "
                                      f"(nvidia-smi says: {_first_line(said)!r}). Load the driver or reboot "
                                      "after installing it, then try again.")
    if "no devices were found" in lowered:
        return GpuSnapshot([], False, "This host has no GPU: the NVIDIA driver is loaded but finds no device.")
    if rc != 0:
        return GpuSnapshot([], False, f"nvidia-smi failed with exit code {rc}: {_first_line(said) or 'no output'}")
    if apps_rc != 0:
        # Without the process list a held GPU would look free, so report nothing rather than a wrong "free".
        said_apps = _first_line("\n".join((stdout_apps, stderr))) or "no output"
        return GpuSnapshot([], False, f"nvidia-smi could not list GPU processes (exit code {apps_rc}: "
                                      f"{said_apps}), so who holds the GPUs is unknown.")
    try:
        gpus = parse_gpus(stdout_gpu, stdout_apps)
    except ValueError as exc:
        return GpuSnapshot([], False, f"Could not read nvidia-smi's output ({exc}); is the driver healthy?")
    if not gpus:
        return GpuSnapshot([], False, "This host has no GPU: nvidia-smi lists none.")
    return GpuSnapshot(gpus, True, None)


def attach_users(snapshot: GpuSnapshot, users: dict[int, str | None]) -> None:
    """Name each process's owner (the host side looks them up: worker/hostside/gpus.py)."""
    for gpu in snapshot.gpus:
        for proc in gpu.processes:
            proc.user = users.get(proc.pid, proc.user)


def foreign_gpu_holders(
    snapshot: GpuSnapshot, our_pids: set[int], gpu_indices: list[int] | None
) -> list[GpuProcess]:
    """Processes that are not ours on the GPUs a run needs (all of the host's when gpu_indices is None)."""
    wanted = None if gpu_indices is None else set(gpu_indices)
    return [
        proc
        for gpu in snapshot.gpus
        if wanted is None or gpu.index in wanted
        for proc in gpu.processes
        if proc.pid not in our_pids
    ]


def pick_free_gpus(snapshot: GpuSnapshot, n: int, our_pids: set[int]) -> list[int] | None:
    """The n lowest-indexed GPUs that no foreign process holds, or None when fewer than n are free."""
    if n < 1:
        raise ValueError(f"a run needs at least one GPU, asked for {n}")
    free = [
        gpu.index
        for gpu in snapshot.gpus
        if all(proc.pid in our_pids for proc in gpu.processes)
    ]
    return sorted(free)[:n] if len(free) >= n else None


def _describe(proc: GpuProcess) -> str:
    details = [proc.process_name] if proc.process_name else []
    if proc.user:
        details.append(f"user {proc.user}")
    if proc.used_memory_mib is not None:
        details.append(f"{proc.used_memory_mib} MiB")
    return f"pid {proc.pid}" + (f" ({', '.join(details)})" if details else "")


def holders_message(procs: list[GpuProcess]) -> str:
    """One sentence per GPU naming who holds it, e.g. "GPU 0 is held by pid 568 (python3, user alice, 20076 MiB)"."""
    by_gpu: dict[int, list[GpuProcess]] = {}
    for proc in procs:
        by_gpu.setdefault(proc.gpu_index, []).append(proc)
    return "; ".join(
        f"GPU {index} is held by " + " and ".join(_describe(p) for p in sorted(held, key=lambda p: p.pid))
        for index, held in sorted(by_gpu.items())
    )
