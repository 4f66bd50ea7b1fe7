"""The serving engine in the per-round cost: how the draft runs next to a tensor-parallel verifier.

Where the draft runs, read from the engines' sources:

- SGLang (`sglang`): the EAGLE worker is a TpModelWorker built with the target's `tp_rank` in the target's tensor
  group (python/sglang/srt/speculative/eagle_worker.py, `EAGLEWorker.__init__`, sgl-project/sglang at commit
  00559eacbf0841146db7e27e445d1971e35e6294; a separate group only with dp-attention), and the EAGLE-3 draft's layers
  are the tensor-parallel ones: VocabParallelEmbedding, QKVParallelLinear / row-parallel o_proj, LlamaMLP's
  row-parallel down_proj, ParallelLMHead (python/sglang/srt/models/llama_eagle3.py at commit
  03d5a7771f6082e7737a5f19cae7d1e863087013). So every draft forward pays, at the target's tp, three all-reduces of
  its tokens x draft hidden size (embedding, attention, MLP) and one all-gather of its logits
  (`LogitsProcessor._get_logits` → `tensor_model_parallel_all_gather`, python/sglang/srt/layers/logits_processor.py
  at commit 009db01a7c0d5460611d543516401eb497641918), priced as an all-gather: half an all-reduce of its output
  bytes (ring: tp - 1 steps to the all-reduce's 2 (tp - 1); CostModel.allgather_latency_us). RFC #14343 (a
  draft tp of its own) is still open. A round at depth d runs d draft forwards: the draft-extend forward over
  the tokens accepted last round (taken as d + 1), which gives the first top-k, and d - 1 decode forwards over
  top-k tokens each (`EAGLEWorker.draft`: the last of speculative_num_steps selections runs no forward).
- vLLM (`vllm`) by engine version (`engine_version`):
  - V1 (0.8 and later, and the default when no version is given): `EagleProposer.load_model` builds the draft with
    `get_model(vllm_config=self.vllm_config, model_config=draft_model_config)` (vllm/v1/spec_decode/eagle.py,
    vllm-project/vllm at commit f7eef1b6987f4780fe8636077682936fe075aa2f): the target's parallel config, so the
    draft shards over the target's tensor group whatever `draft_tensor_parallel_size` says (vllm-project/vllm#17499
    "Specifying draft TP does not have any impact" is open). Priced as SGLang's: sharded at the target's tp.
  - V0 (before 0.8, or "v0"): `SmallerTpProposerWorker` (vllm/spec_decode/smaller_tp_proposer_worker.py at commit
    0f79d54e130ad86876bbefa837bd09b2ae17eaf8) runs a draft with `draft_tensor_parallel_size: 1` on its own rank
    group: `draft_tp=1` is a replicated draft (no collective, its full weight read per step); unset it is the
    target's tp (`SpeculativeConfig._verify_and_get_draft_tp`).
- `measured`: the round's cost by depth as timed on the serving box (`round_ms`), nothing modelled.

A sharded draft reads 1/tp of its weights per step (draft_step_ms / tp) but pays the collectives; a replicated
one reads all of them (draft_step_ms). Which wins depends on the interconnect's per-call time, and so does the
depth: at tp=8 over PCIe a sharded step can cost more than a replicated one, which makes each extra depth dearer.

Tree drafting (topk > 1, SGLang's speculative_eagle_topk): each decode forward runs topk tokens and the verifier
checks topk * d + 1 tokens (all drafted tokens; SGLang's speculative_num_draft_tokens at its largest). Its
acceptance is NOT modelled: the tree's τ by depth is taken equal to the chain's, which is all that sim_acc_k and
`evaluate` measure (greedy top-1, no per-position top-k acceptance). That is a lower bound (a tree accepts at least
what its top-1 branch does), so a tree here shows its cost, not its gain, and never serves faster than the chain
with the same acceptance; every answer with topk > 1 says so (`drafting.acceptance`). Give acceptance measured with
a tree to judge one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from server.advisor.cost import CostModel, check_number
from server.advisor.releases import VLLM_EAGLE3, nearest_read, parse_version
from server.advisor.tables import DEFAULT_DRAFT_VOCAB, DEFAULT_HBM_BYTES_PER_S

SGLANG_PLACEMENT = (
    "SGLang runs the EAGLE worker in the target's tensor group: python/sglang/srt/speculative/eagle_worker.py "
    "(EAGLEWorker.__init__, sgl-project/sglang@00559eacbf0841146db7e27e445d1971e35e6294) with the tensor-parallel "
    "layers of python/sglang/srt/models/llama_eagle3.py (@03d5a7771f6082e7737a5f19cae7d1e863087013); its logits "
    "all-gathered in python/sglang/srt/layers/logits_processor.py (LogitsProcessor._get_logits, "
    "@009db01a7c0d5460611d543516401eb497641918)")
SGLANG_DP_PLACEMENT = (
    "SGLang with dp-attention (--dp-size {dp}) runs the EAGLE-3 draft in its own attention group of {group} rank(s), "
    "not the target's tensor group: sglang 0.5.23's wheel, sglang/srt/speculative/draft_parallel.py "
    "(resolve_draft_parallel_layout: EAGLE-3 is SINGLE_GROUP, and with attn_dp_enabled its tp_group is the attention "
    "group, attn_tp_size = tp / dp); its collectives priced on the tp table (at most what a smaller group pays)")
VLLM_V1_PLACEMENT = (
    "vLLM V1 builds the draft with the target's config: vllm/v1/spec_decode/eagle.py (EagleProposer.load_model -> "
    "get_model(vllm_config=self.vllm_config, ...), vllm-project/vllm@f7eef1b6987f4780fe8636077682936fe075aa2f), so "
    "it shards over the target's tp whatever draft_tensor_parallel_size says (vllm-project/vllm#17499, open)")
VLLM_V0_PLACEMENT = (
    "vLLM V0 runs a draft_tensor_parallel_size 1 draft on its own ranks: vllm/spec_decode/"
    "smaller_tp_proposer_worker.py (SmallerTpProposerWorker, vllm-project/vllm@0f79d54e130ad86876bbefa837bd09b2ae17eaf8)"
    "; unset, the target's tp (SpeculativeConfig._verify_and_get_draft_tp)")
_VERSION = re.compile(r"^v?(\d+)(?:\.(\d+))?")


def vllm_eagle3_refusal(engine_version: str | None, model_type: str, architecture: str = "") -> str | None:
    """Why this vLLM release would refuse an EAGLE-3 draft for a target of `model_type` (its text config's) and
    `architecture` (config.json's first `architectures`), or None: the facts of longrun/draft_releases.py
    VLLM_EAGLE3, read from each minor release's wheel, 0.11.0 to 0.34.0, with the file and line of each check. A
    release between two read ones follows the older. One outside them (newer than the newest read, or V0, older
    than all) is unverified, not assumed: not priced, naming the release read to price it on; no version or "v1"
    is the newest read. An architecture outside EAGLE3_CHECKED is judged by the model_type list alone."""
    releases = tuple(VLLM_EAGLE3)
    text = (engine_version or "").strip().lower()
    version = releases[-1] if text in ("", "v1") else "0" if text == "v0" else text
    release, outside = nearest_read(releases, version)
    if outside:
        edge = "newer than the newest" if outside > 0 else "older than the oldest"
        return (f"vLLM {engine_version} is {edge} release read for EAGLE-3 targets ({release}): whether it serves "
                f"an EAGLE-3 draft for a {model_type or architecture!r} verifier is unverified "
                f"(longrun/draft_releases.py); not priced. Give deploy.engine_version {release} to price it on "
                f"{release}'s rules")
    facts = VLLM_EAGLE3[release]
    judged = "" if parse_version(version) == parse_version(release) else f" ({engine_version} follows {release})"
    where = f"vllm {release} {facts.source}"
    if facts.model_types is not None and model_type and not any(name in model_type for name in facts.model_types):
        return (f"vLLM {release} refuses an EAGLE-3 draft for a {model_type!r} verifier{judged}: "
                f"eagle3_target_supported serves only targets whose model_type names {', '.join(facts.model_types)} "
                f"({where}); not priced. Serve it with SGLang (deploy.engine: sglang) or a vLLM release that does")
    if architecture in facts.without_interface:
        return (f"vLLM {release} refuses an EAGLE-3 draft for a {architecture} verifier{judged}: its model class "
                f"does not implement SupportsEagle3, and the model runner stops at load ({where}); not priced. "
                "Serve it with SGLang (deploy.engine: sglang) or a vLLM release that does")
    return None


def vllm_generation(engine_version: str | None) -> str:
    """"v1" or "v0": the engine that runs the EAGLE proposer for this vLLM version (unset: V1, the default
    since 0.8)."""
    if engine_version is None:
        return "v1"
    text = engine_version.strip().lower()
    if text in ("v0", "v1"):
        return text
    m = _VERSION.match(text)
    if not m:
        raise ValueError(f"engine_version {engine_version!r}: give vLLM's version (0.11.0) or v0 / v1")
    major, minor = int(m.group(1)), int(m.group(2) or 0)
    return "v0" if (major, minor) < (0, 8) else "v1"


Engine = Literal["sglang", "vllm", "measured"]
ENGINES = ("sglang", "vllm", "measured")
# SGLang's EAGLE-3 draft layer: embedding, attention output and MLP output all-reduces per forward
DRAFT_ALLREDUCES_PER_FORWARD = 3
CHAIN_ACCEPTANCE = "the chain's (greedy top-1), as measured"
TREE_ACCEPTANCE = (
    "the chain's (greedy top-1) taken for the top-{topk} tree, not modelled: sim_acc_k and evaluate measure no "
    "top-k acceptance. A lower bound (a tree accepts at least what its top-1 branch does): its {topk} x depth + 1 "
    "verified tokens and top-{topk} draft forwards are priced, its extra acceptance is not, so here a tree never "
    "serves faster than the chain; judge a tree by acceptance measured with one"
)


class RoundTerms(BaseModel):
    """One round's cost, term by term, so that a user can redo it by hand (ms; all-reduce sizes in bytes)."""

    verifier_ms: float = Field(description="verifier forward over the verified tokens, without communication")
    verified_tokens: int
    verifier_allreduces: int = Field(description="layers x all-reduces per layer")
    verifier_allreduce_bytes: int
    verifier_allreduce_ms: float
    verifier_alltoalls: int = Field(0, description="expert-parallel dispatch + combine calls (MoE layers, ep > 1)")
    verifier_alltoall_ms: float = 0.0
    draft_forwards: int
    draft_compute_ms: float = Field(description="draft_round_ms + forwards x per-forward weight read")
    draft_allreduces: int = Field(0, description="collectives of a sharded draft: its all-reduces and its logits "
                                  "all-gather, one call each")
    draft_allreduce_ms: float = 0.0
    round_ms: float


@dataclass(frozen=True)
class Drafting:
    """How the engine runs the draft: engine, tree width, the draft's own tp and shape; `round_ms` for measured."""

    engine: str = "sglang"
    topk: int = 1
    draft_tp: int | None = None  # vllm only: draft_tensor_parallel_size (1 or the target's tp; V0 honours 1)
    engine_version: str | None = None  # vllm: V1 (default) shards the draft at tp; V0 honours draft_tp
    draft_hidden: int | None = None  # default: the verifier's hidden size (EAGLE-3 drafts share it)
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    round_ms: dict[int, float] | None = None  # measured: round cost by depth (0: no speculation)
    attention_dp: int = 1  # sglang: --enable-dp-attention --dp-size; attention and the draft in groups of tp/dp

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        for name in ("topk", "draft_vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.attention_dp != 1 and self.engine != "sglang":
            raise ValueError("attention_dp is SGLang's --enable-dp-attention --dp-size: give it with engine sglang")
        if self.draft_tp is not None and self.engine != "vllm":
            raise ValueError("draft_tp is vLLM's draft_tensor_parallel_size; SGLang runs the draft at the target's tp")
        if self.engine == "vllm":
            vllm_generation(self.engine_version)  # validates it
        if self.engine == "measured":
            if not self.round_ms:
                raise ValueError("engine measured needs round_ms: the round's cost by depth, ms")
            for depth, ms in self.round_ms.items():
                check_number(ms, f"round_ms[{depth}]", low=1e-9)
            object.__setattr__(self, "round_ms", {int(d): float(ms) for d, ms in self.round_ms.items()})

    def group(self, tp: int) -> int:
        """The ranks one draft forward spans: the target's tp, or with SGLang's dp-attention its attention group."""
        if self.engine == "sglang" and self.attention_dp > 1:
            if tp % self.attention_dp:
                raise ValueError(f"dp-attention needs the tp ({tp}) a multiple of its dp size ({self.attention_dp})")
            return tp // self.attention_dp
        return tp

    def sharded(self, tp: int) -> bool:
        if self.engine == "sglang":
            return self.group(tp) > 1
        if self.engine == "vllm":
            draft_tp = self.draft_tp or tp
            if draft_tp not in (1, tp):
                raise ValueError(f"vLLM accepts draft_tensor_parallel_size 1 or the target's tp ({tp}), "
                                 f"not {draft_tp}")
            return tp > 1 and (vllm_generation(self.engine_version) == "v1" or draft_tp > 1)
        return False

    def placement(self, tp: int) -> str:
        """Where the engine puts the draft, and the code that says so (file and commit)."""
        if self.engine == "sglang":
            return SGLANG_PLACEMENT if self.attention_dp == 1 else SGLANG_DP_PLACEMENT.format(
                dp=self.attention_dp, group=self.group(tp))
        if self.engine == "vllm":
            if vllm_generation(self.engine_version) == "v0":
                return VLLM_V0_PLACEMENT
            ignored = (f"; draft_tp={self.draft_tp} is not honoured there" if self.draft_tp not in (None, tp) else "")
            return VLLM_V1_PLACEMENT + ignored
        return "measured: the round's cost as timed, no placement modelled"

    def describe(self, tp: int) -> str:
        if self.engine == "measured":
            return f"measured round cost at depths {sorted(self.round_ms or {})}"
        shape = "chain" if self.topk == 1 else f"tree, top-{self.topk} per step (acceptance: the chain's, a lower bound)"
        where = (f"draft sharded at tp={self.group(tp)}: {DRAFT_ALLREDUCES_PER_FORWARD} all-reduces + 1 logits "
                 "all-gather per draft forward" if self.sharded(tp) else "draft replicated on every rank: no collective")
        if self.attention_dp > 1:
            where += f" (dp-attention, dp {self.attention_dp})"
        engine = self.engine if self.engine != "vllm" else f"vllm {vllm_generation(self.engine_version).upper()}"
        return f"{engine}, {shape}, {where}"

    def acceptance(self) -> str:
        """What the answer's acceptance (τ by depth) is for this drafting: the chain's, a lower bound for a tree."""
        if self.topk == 1:
            return CHAIN_ACCEPTANCE
        return TREE_ACCEPTANCE.format(topk=self.topk)


class EngineCost:
    """A CostModel with the engine's drafting: round_ms(d) and its terms(d)."""

    def __init__(self, cost: CostModel, drafting: Drafting):
        self.cost, self.drafting = cost, drafting
        drafting.sharded(cost.tp)  # validates draft_tp against tp
        measured = drafting.round_ms or {}
        if drafting.engine == "measured" and 0 not in measured:
            measured = {**measured, 0: cost.round_ms(0)}
        self._measured = measured

    @property
    def tp(self) -> int:
        return self.cost.tp

    def verified_tokens(self, depth: int) -> int:
        return self.drafting.topk * depth + 1

    def terms(self, depth: int) -> RoundTerms:
        c, k = self.cost, self.drafting.topk
        if self.drafting.engine == "measured":
            if depth not in self._measured:
                raise ValueError(f"round_ms has no depth {depth}; measured: {sorted(self._measured)}")
            ms = self._measured[depth]
            return RoundTerms(verifier_ms=ms, verified_tokens=depth + 1, verifier_allreduces=0,
                              verifier_allreduce_bytes=0, verifier_allreduce_ms=0.0, draft_forwards=depth,
                              draft_compute_ms=0.0, round_ms=ms)
        tokens = self.verified_tokens(depth)
        verifier_ms = c.verifier_ms(tokens - 1)
        calls = c.allreduce_calls
        message = tokens * c.hidden * c.bytes_per_value
        alltoall = c.alltoall_ms(tokens - 1)
        verifier_comm = c.comm_ms(tokens - 1) - alltoall
        collectives = {"verifier_allreduces": calls, "verifier_allreduce_bytes": message,
                       "verifier_allreduce_ms": verifier_comm, "verifier_alltoalls": c.alltoall_calls,
                       "verifier_alltoall_ms": alltoall}
        if depth == 0:
            return RoundTerms(verifier_ms=verifier_ms, verified_tokens=1, **collectives, draft_forwards=0,
                              draft_compute_ms=0.0, round_ms=verifier_ms + verifier_comm + alltoall)
        sharded, group = self.drafting.sharded(c.tp), self.drafting.group(c.tp)
        per_forward = c.draft_step_ms / group if sharded else c.draft_step_ms
        draft_compute = c.draft_round_ms + depth * per_forward
        if sharded and self.drafting.engine == "sglang":
            # the EAGLE-3 fc (3 x hidden -> hidden) is a torch.nn.Linear, replicated on every rank (sglang 0.5.23,
            # sglang/srt/models/llama_eagle3.py): read whole once a round, not 1/tp of it
            draft_compute += 3 * c.hidden * c.hidden * c.bytes_per_value * (1 - 1 / group) / DEFAULT_HBM_BYTES_PER_S * 1e3
        draft_calls, draft_comm = 0, 0.0
        if sharded:
            hidden = self.drafting.draft_hidden or c.hidden
            # the extend forward over the accepted tokens, then depth - 1 decode forwards over top-k tokens
            # (the extend's logits are its last token's: one row; a decode forward's are top-k rows)
            for forward_tokens, rows in [(depth + 1, 1)] + [(k, k)] * (depth - 1):
                draft_comm += DRAFT_ALLREDUCES_PER_FORWARD * c.allreduce_latency_us(
                    forward_tokens * hidden * c.bytes_per_value) / 1000
                draft_comm += c.allgather_latency_us(rows * self.drafting.draft_vocab * c.bytes_per_value) / 1000
                draft_calls += DRAFT_ALLREDUCES_PER_FORWARD + 1
        total = verifier_ms + verifier_comm + alltoall + draft_compute + draft_comm
        return RoundTerms(verifier_ms=verifier_ms, verified_tokens=tokens, **collectives, draft_forwards=depth,
                          draft_compute_ms=draft_compute, draft_allreduces=draft_calls, draft_allreduce_ms=draft_comm,
                          round_ms=total)

    def round_ms(self, depth: int) -> float:
        return self.terms(depth).round_ms


class DraftingPublic(BaseModel):
    engine: str
    engine_version: str | None = None
    topk: int
    draft_tp: int | None
    sharded: bool
    description: str
    placement: str = Field("", description="where the engine puts the draft, citing the engine's file and commit")
    acceptance: str = Field(description="what the τ by depth is for this drafting: the chain's as measured; for a "
                            "tree (topk > 1) the chain's too, a lower bound: a tree's acceptance is not modelled")
    acceptance_is_lower_bound: bool = Field(description="true for a tree: its τ is the chain's, not its own")


def drafting_public(drafting: Drafting, tp: int) -> DraftingPublic:
    return DraftingPublic(engine=drafting.engine, engine_version=drafting.engine_version, topk=drafting.topk,
                          draft_tp=drafting.draft_tp, sharded=drafting.sharded(tp), description=drafting.describe(tp),
                          placement=drafting.placement(tp),
                          acceptance=drafting.acceptance(),
                          acceptance_is_lower_bound=drafting.topk > 1)
