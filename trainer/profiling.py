"""torch.profiler over a window of training steps, on rank 0, when asked through the environment.

    LONGRUN_PROFILE_DIR=D [LONGRUN_PROFILE_STEPS=WAIT:ACTIVE] torchrun ... -m trainer.train ...

Skips WAIT steps (default 20), warms up over 3, records ACTIVE steps (default 10), then writes
D/trace.json (chrome://tracing or Perfetto: the CPU launch timeline against the GPU's) and
D/summary.txt: wall time per step, the share of it in which the GPU was busy (kernels, copies,
memsets), and the ops that took the most host and device time.
"""

import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

PROFILE_DIR_ENV = "LONGRUN_PROFILE_DIR"
PROFILE_STEPS_ENV = "LONGRUN_PROFILE_STEPS"
WARMUP = 3
DEVICE_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # trace event categories of work on the device


def device_busy_seconds(trace: dict) -> float:
    """Time during which at least one kernel, copy or memset ran on the device, from a Chrome trace
    (events on several streams at once count once)."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in trace.get("traceEvents", [])
                   if e.get("ph") == "X" and e.get("cat") in DEVICE_ACTIVITY)
    busy, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e6  # µs -> s


class StepProfiler:
    """Call `step()` after every optimizer step and `close()` at the end; a no-op unless asked for."""

    def __init__(self, rank: int):
        self.directory = os.environ.get(PROFILE_DIR_ENV)
        self.profiler: profile | None = None
        self.step_times: list[float] = []
        if not self.directory or rank != 0:
            return
        wait, active = (int(x) for x in os.environ.get(PROFILE_STEPS_ENV, "20:10").split(":"))
        self.active = active
        self.recording_from = wait + WARMUP
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities, schedule=schedule(wait=wait, warmup=WARMUP, active=active, repeat=1),
                                on_trace_ready=self._save)
        self.profiler.start()
        self.steps = 0

    def step(self) -> None:
        if self.profiler is None:
            return
        # call n ends step n; the profiler records steps recording_from .. recording_from + active - 1
        if self.recording_from - 1 <= self.steps <= self.recording_from + self.active - 1:
            self.step_times.append(time.perf_counter())
        self.steps += 1
        self.profiler.step()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def _save(self, prof: profile) -> None:
        directory = Path(self.directory)
        directory.mkdir(parents=True, exist_ok=True)
        trace = directory / "trace.json"
        prof.export_chrome_trace(str(trace))
        averages = prof.key_averages()
        steps = max(1, len(self.step_times) - 1)
        wall = (self.step_times[-1] - self.step_times[0]) if len(self.step_times) > 1 else 0.0
        gpu = torch.cuda.is_available()
        busy = device_busy_seconds(json.loads(trace.read_text())) if gpu else 0.0
        lines = [
            f"steps recorded: {steps}; wall {1000 * wall / steps:.2f} ms/step"
            + (f"; GPU busy {1000 * busy / steps:.2f} ms/step, {busy / wall:.1%} of the wall time"
               if gpu and wall else ""),
            "",
            "by host time:",
            averages.table(sort_by="self_cpu_time_total", row_limit=25),
        ]
        if gpu:
            lines += ["by device time:", averages.table(sort_by="self_device_time_total", row_limit=25)]
        (directory / "summary.txt").write_text("\n".join(lines) + "\n")


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime), or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            started_ticks = int(f.read().rpartition(b")")[2].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Where a training rank's start-up goes, phase by phase, said once in one line when the first step has ended:

        startup: 19.4 s to the end of step 1 (process start 0.2 s, imports 3.1 s, model 0.4 s, data 1.1 s,
        first step 14.6 s: torch.compile warm-up)

    `mark(phase)` ends a phase; the first phase starts when the process did (as far as /proc says)."""

    def __init__(self, since_process_start: bool = True) -> None:
        age = process_age() if since_process_start else None
        self.started = time.monotonic() - (age if age is not None else 0.0)
        self.last = self.started
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self.last))
        self.last = now

    def summary(self) -> str:
        total = self.last - self.started
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        return f"startup: {total:.1f} s to the end of step 1 ({parts})"
