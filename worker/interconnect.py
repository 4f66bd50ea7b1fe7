"""Measuring a host's interconnect: `nvidia-smi topo -m` and the NCCL all-reduce sweep (worker/allreduce_sweep.py)
run there through hostside's `interconnect` verb, read here, stored with the host; and beside that table the
deployment's verifier, one decoder layer of its shape timed there (worker/verifier_probe.py, the `verifier` verb).

Every output is untrusted input: the topology parser keeps what it recognises and says what it could not
read; the sweep's and the verifier probe's JSON are checked field by field (the latter by server/advisor/verifier.py
read_probe), and anything else fails the probe with the reason. POST /v1/hosts/{name}/interconnect marks the host
(hosts.interconnect_wanted_tp), POST /v1/hosts/{name}/verifier too (hosts.verifier_wanted); InterconnectResponder
answers both, one host's probes one after the other (both write host.interconnect).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from sqlalchemy import or_, select

from server.advisor.verifier import read_probe
from server.db import Database
from server.layout import HostLayout
from server.models import Host
from worker.clock import Clock
from worker.host_contact import HostContact
from worker.host_errors import HostError
from worker.protocol import CommandOutput, InterconnectRequest, VerifierProbeRequest

SWEEP_SOURCE = (Path(__file__).parent / "allreduce_sweep.py").read_text()
SWEEP_NAME = f"allreduce-sweep-{hashlib.sha256(SWEEP_SOURCE.encode()).hexdigest()[:12]}.py"
# NCCL setup plus 15 sizes x 5 timings; a host that takes longer than this is not measuring
SWEEP_TIMEOUT = 600.0
# a sane sweep has a few dozen sizes; more is not a table of ours
MAX_ROWS = 256
MAX_GPUS = 1024
VERIFIER_PROBE_SOURCE = (Path(__file__).parent / "verifier_probe.py").read_text()
VERIFIER_PROBE_NAME = f"verifier-probe-{hashlib.sha256(VERIFIER_PROBE_SOURCE.encode()).hexdigest()[:12]}.py"
# 16 token counts x a dense and an MoE layer, each built and captured as a CUDA graph (a Kimi-K2.5 MoE layer's
# int4 weights are made on the GPU for each)
VERIFIER_PROBE_TIMEOUT = 900.0

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU = re.compile(r"^GPU(\d+)$")
_NVLINK = re.compile(r"^NV(\d+)$")
# nvidia-smi topo -m's legend: every way two GPUs can be connected, fastest (NVLink) apart
PCIE_PATHS = {"PIX", "PXB", "PHB", "NODE", "SYS"}


class ProbeFailed(Exception):
    """The host answered, but not with a measurement: the message says why and what to do."""


def parse_topology(text: str) -> dict[str, Any]:
    """The GPU-to-GPU matrix of `nvidia-smi topo -m`: {"gpus", "links": [{"a", "b", "path"}], "interconnect":
    "nvlink" (every pair over NVLink), "pcie" (some pair over a PCIe path) or None, "note"}.

    Tolerates ANSI codes (nvidia-smi underlines its header even into a pipe), NIC and affinity columns, and
    garbage: what it cannot read it leaves out and says so in `note`."""
    lines = [_ANSI.sub("", line).rstrip() for line in text[:MAX_GPUS * 4096].splitlines()]
    header = next((line.split() for line in lines if line.split()[:1] == ["GPU0"]), None)
    if header is None:
        return {"gpus": 0, "links": [], "interconnect": None, "note": "no GPU matrix in the nvidia-smi topo -m output"}
    columns = [int(m.group(1)) if (m := _GPU.match(cell)) else None for cell in header]
    links, skipped = {}, 0
    for line in lines:
        cells = line.split()
        row = _GPU.match(cells[0]) if cells else None
        if row is None or cells == header:
            continue
        a = int(row.group(1))
        # "X" (self) and the path names are one token each; later cells are CPU/NUMA affinity
        for b, path in zip(columns, cells[1:], strict=False):
            if b is None or a == b:
                continue
            if path in PCIE_PATHS or _NVLINK.match(path):
                links[(min(a, b), max(a, b))] = path
            else:
                skipped += 1
    gpus = sorted({i for pair in links for i in pair})
    kinds = {"nvlink" if _NVLINK.match(path) else "pcie" for path in links.values()}
    note = f"{skipped} cell(s) of the GPU matrix were not a known link type" if skipped else None
    if not links:
        note = note or "no link between two GPUs in the nvidia-smi topo -m matrix (one GPU, or unreadable)"
    return {"gpus": len(gpus), "links": [{"a": a, "b": b, "path": p} for (a, b), p in sorted(links.items())],
            "interconnect": None if not kinds else "pcie" if "pcie" in kinds else "nvlink", "note": note}


def _json_answer(output: CommandOutput, what: str) -> dict[str, Any]:
    """A probe script's last stdout line as a JSON object; ProbeFailed with its exit status and output's tail else."""
    lines = output.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        tail = (output.stderr or output.stdout).strip()[-1500:]
        raise ProbeFailed(f"the {what} did not answer JSON (exit {output.rc}): {tail!r}")
    return answer


def read_sweep(output: CommandOutput, tp: int | str) -> dict[str, Any]:
    """The sweep's measurement, checked; ProbeFailed with the reason when it is not one."""
    answer = _json_answer(output, "all-reduce sweep")
    if "error" in answer:
        raise ProbeFailed(f"the all-reduce sweep could not measure: {str(answer['error'])[:1000]}")
    world = answer.get("world")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_GPUS:
        raise ProbeFailed(f"the all-reduce sweep's answer has no valid world size: {world!r}")
    if tp != "all" and world != tp:
        raise ProbeFailed(f"the all-reduce sweep measured {world} ranks, not the tp={tp} asked for")
    rows = answer.get("allreduce")
    if not isinstance(rows, list) or len(rows) > MAX_ROWS or (world > 1 and not rows):
        raise ProbeFailed(f"the all-reduce sweep's answer has no table of at most {MAX_ROWS} sizes")
    table = []
    for row in rows:
        nbytes, us = (row.get("bytes"), row.get("us")) if isinstance(row, dict) else (None, None)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise ProbeFailed(f"the all-reduce sweep's row {row!r} has no valid message size")
        if isinstance(us, bool) or not isinstance(us, int | float) or not math.isfinite(us) or us < 0:
            raise ProbeFailed(f"the all-reduce sweep's row {row!r} has no valid time")
        table.append({"bytes": nbytes, "us": float(us)})
    gpus = answer.get("gpus")
    count = answer.get("gpu_count")
    env = answer.get("nccl_env")
    return {"tp": world, "allreduce": sorted(table, key=lambda r: r["bytes"]),
            "gpus": [str(g)[:128] for g in gpus[:MAX_GPUS]] if isinstance(gpus, list) else [],
            "gpu_count": count if isinstance(count, int) and not isinstance(count, bool) else None,
            "nccl_env": {str(k)[:128]: str(v)[:256] for k, v in env.items()} if isinstance(env, dict) else {}}


def measurement(topo: CommandOutput, sweep: CommandOutput, tp: int | str) -> dict[str, Any]:
    """What is stored with the host: the checked sweep table and the parsed topology of its GPUs."""
    table = read_sweep(sweep, tp)
    if topo.rc == 0:
        topology = parse_topology(topo.stdout)
    else:
        topology = {"gpus": 0, "links": [], "interconnect": None,
                    "note": f"nvidia-smi topo -m failed (exit {topo.rc}): {topo.stderr.strip()[-300:]}"}
    # the links among the GPUs the sweep used (the first tp) decide what the table measured
    used = [link for link in topology["links"] if max(link["a"], link["b"]) < table["tp"]]
    kinds = {"nvlink" if _NVLINK.match(link["path"]) else "pcie" for link in used}
    table["interconnect"] = None if not kinds else "pcie" if "pcie" in kinds else "nvlink"
    if table["nccl_env"].get("NCCL_P2P_DISABLE") == "1":
        table["interconnect"] = "pcie"  # NCCL went through host memory whatever the links are
    table["topology"] = topology
    return table


def verifier_measurement(output: CommandOutput, wanted: dict[str, Any], host: str, measured_at: str) -> dict[str, Any]:
    """The verifier probe's layer times, checked (read_probe) and of the tp and ep asked for: what is stored as
    host.interconnect["verifier"]; ProbeFailed with the reason when it is not one."""
    answer = _json_answer(output, "verifier probe")
    try:
        stored = read_probe(answer, host, measured_at)
    except ValueError as exc:
        raise ProbeFailed(str(exc)) from None
    if stored["tp"] != wanted["tp"] or stored["ep"] != wanted["ep"]:
        raise ProbeFailed(f"the verifier probe timed tp={stored['tp']} ep={stored['ep']}, not the "
                          f"tp={wanted['tp']} ep={wanted['ep']} asked for")
    if not stored["layers_ms_ok"]:
        raise ProbeFailed("the verifier probe answered no layer times")
    return stored


class InterconnectResponder:
    """Answers POST /v1/hosts/{name}/interconnect and POST /v1/hosts/{name}/verifier: runs each probe asked of a host
    marked for one, the all-reduce sweep first."""

    def __init__(self, db: Database, contact: HostContact, clock: Clock):
        self.db, self.contact, self.clock = db, contact, clock

    def run_once(self) -> list[Host]:
        with self.db.reading() as s:
            return list(s.scalars(select(Host).where(or_(Host.interconnect_wanted_tp.is_not(None),
                                                         Host.verifier_wanted.is_not(None)))))

    def answer(self, host: Host) -> None:
        if host.interconnect_wanted_tp is not None:
            self._sweep(host)
        if host.verifier_wanted is not None:
            self._verifier(host, host.verifier_wanted)

    def _sweep(self, host: Host) -> None:
        tp: int | str = host.interconnect_wanted_tp or "all"
        request = InterconnectRequest(tp=tp, sweep_path=f"{HostLayout(host.workspace).bin_dir}/{SWEEP_NAME}",
                                      sweep_source=SWEEP_SOURCE, timeout=SWEEP_TIMEOUT)
        try:
            answer = self.contact.agent(host).call(request, timeout=SWEEP_TIMEOUT + 60)
            measured = measurement(answer.topo, answer.sweep, tp)
        except (HostError, ProbeFailed) as exc:
            with self.db.writing() as s:
                fresh = s.get(Host, host.id)
                fresh.interconnect_error, fresh.interconnect_wanted_tp = str(exc), None
            return
        with self.db.writing() as s:
            fresh = s.get(Host, host.id, with_for_update=True)
            # the verifier's layer times stay beside the new table: they are another probe's
            kept = {"verifier": fresh.interconnect["verifier"]} if "verifier" in (fresh.interconnect or {}) else {}
            fresh.interconnect = {**measured, "measured_at": self.clock.now().isoformat(), **kept}
            fresh.interconnect_error, fresh.interconnect_wanted_tp = None, None

    def _verifier(self, host: Host, wanted: dict[str, Any]) -> None:
        request = VerifierProbeRequest(
            config=wanted["config"], tp=wanted["tp"], ep=wanted["ep"], timeout=VERIFIER_PROBE_TIMEOUT,
            script_path=f"{HostLayout(host.workspace).bin_dir}/{VERIFIER_PROBE_NAME}",
            script_source=VERIFIER_PROBE_SOURCE)
        try:
            answer = self.contact.agent(host).call(request, timeout=VERIFIER_PROBE_TIMEOUT + 60)
            stored = verifier_measurement(answer.probe, wanted, host.name, self.clock.now().isoformat())
            error = None
        except (HostError, ProbeFailed) as exc:
            stored, error = None, str(exc)
        with self.db.writing() as s:
            fresh = s.get(Host, host.id, with_for_update=True)
            if fresh is None:
                return
            if stored is not None:
                fresh.interconnect = {**(fresh.interconnect or {}), "verifier": stored}
            fresh.verifier_error = error
            if fresh.verifier_wanted == wanted:  # another asked for since runs next
                fresh.verifier_wanted = None
