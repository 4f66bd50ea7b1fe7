"""The deployment's cost model for a run: its served verifier's shape from its config.json and the deploy host's
stored probe-verifier timing of it, if any (server/proposal.py prices depths on it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.advisor import CostModel
from server.advisor.engine import vllm_eagle3_refusal
from server.advisor.tables import DEFAULT_KV_CONTEXT_TOKENS
from server.advisor.verifier import Parallelism, VerifierShape, name_of, read_config
from server.models import Host
from server.spec import RunCreate


def verifier_of(session: Session, spec: RunCreate) -> tuple[VerifierShape | None, dict[str, Any] | None, str]:
    """The served verifier's shape from its config.json (deploy.verifier, else the trainer's verifier_path), the
    deploy host's stored probe-verifier timing of it if any, and where the config came from or why it could not
    be read (then the built-in 70B-class default is priced, and the answer says so)."""
    deploy = spec.deploy
    path = deploy.verifier or (spec.trainer.verifier_path if spec.trainer else None)
    if path is None:
        return None, None, "no verifier path (deploy.verifier, or the trainer's verifier_path)"
    host = session.scalar(select(Host).where(Host.name == deploy.host))
    probe = ((host.interconnect or {}).get("verifier") if host else None) or None
    if probe and _same_config(probe.get("path"), path) and isinstance(probe.get("config"), dict):
        config, where = probe["config"], f"read on {deploy.host} by probe-verifier"
    else:
        probe = None
        try:
            config, where = read_config(path), "read by the server"
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return None, None, (f"{path}: {why} where the server can read it; `longrun hosts probe-verifier "
                                f"{deploy.host} --config {path} --tp {deploy.tp or 'N'}` reads it on the deploy host")
    try:
        shape = VerifierShape.from_config(config, name_of(path, config))
    except ValueError as exc:
        return None, None, f"{path}: {exc}"
    timed = probe if probe and probe.get("layers_ms_ok") else None
    return shape, timed, f"{path} ({where})"


def _same_config(a: Any, b: str) -> bool:
    """Whether two paths name one model: a config.json or the directory holding it."""
    def directory(p: str) -> str:
        return p[:-len("/config.json")] if p.endswith("/config.json") else p.rstrip("/")
    return isinstance(a, str) and directory(a) == directory(b)


def cost_model(session: Session, spec: RunCreate, tp: int, table: tuple) -> CostModel:
    deploy = spec.deploy
    shape, timed, where = verifier_of(session, spec)
    if shape is None:
        return CostModel.for_interconnect("nvlink", tp, allreduce_us=table,
                                          basis={"verifier_forward": f"modelled: the built-in default ({where})"})
    ep = deploy.ep or 1
    parallel = Parallelism(tp, ep if shape.experts and ep == tp else 1, mla_a_replicated=deploy.engine == "sglang",
                           attention_dp=deploy.dp_attention or 1)
    try:
        return CostModel.for_verifier(shape, parallel, table, measured=timed,
                                      context_tokens=deploy.context_tokens if deploy.context_tokens is not None
                                      else DEFAULT_KV_CONTEXT_TOKENS)
    except ValueError as exc:  # a stored timing of another tp or ep: model it, saying so
        model = CostModel.for_verifier(shape, parallel, table)
        again = (f"`longrun hosts probe-verifier {deploy.host} --config {timed['path'] if timed else 'PATH'} --tp {tp}"
                 f"{f' --ep {parallel.ep}' if parallel.ep > 1 else ''}` times it")
        return dataclasses.replace(model, basis={
            **model.basis, "verifier_forward": f"{model.basis['verifier_forward']} ({exc}: {again})"})




def engine_refusal(session: Session, spec: RunCreate) -> str | None:
    """Why the deployment's engine would refuse to serve an EAGLE-3 draft for this verifier, or None (an unread
    verifier is priced on the built-in default, which every engine serves)."""
    deploy = spec.deploy
    if deploy.engine != "vllm":
        return None
    shape, _, _ = verifier_of(session, spec)
    if not shape or not (shape.model_type or shape.architecture):
        return None
    return vllm_eagle3_refusal(deploy.engine_version, shape.model_type, shape.architecture)
