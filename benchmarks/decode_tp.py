"""A real tensor-parallel speculative decode, measured against the depth advisor's prediction (issue 19).

    python benchmarks/decode_tp.py --out OUT                     # tp=2 on two GPUs: default transport (NVLink),
                                                                 # then NCCL_P2P_DISABLE=1 (through host memory)
    python benchmarks/decode_tp.py --out OUT --tp 1              # one GPU: no all-reduce
    python benchmarks/decode_tp.py --out OUT --tp 1 --smoke      # every piece once, small: run this first
    python benchmarks/decode_tp.py --out OUT --no-cuda-graphs    # eagerly, shapes changing every round
    python benchmarks/decode_tp.py --out OUT --device cpu --tiny # the same code on a CPU (gloo), for a smoke run
    python benchmarks/decode_tp.py --compare OUT/results.json    # the comparison again, anywhere longrun imports

What runs, on each link:
- a Llama-shaped verifier built from a config (default: Llama-3-8B's shapes cut to --layers layers, random bf16
  weights), split over tp ranks as a tensor-parallel decode is: q/k/v and gate/up column-parallel, o and down
  row-parallel, one all-reduce after the attention and one after the MLP of every layer; embedding and lm_head
  replicated; a KV cache;
- the trainer's EAGLE-3 draft (trainer/model.py; random, or --draft DIR as the trainer saved it) replicated on
  every rank, as the advisor assumes, with a KV cache of its own: each round one step over the positions the
  verifier accepted last round (their features), then d-1 chained steps on its own hidden states;
- greedy chain speculation at depths 0 (no draft) to --max-depth: the draft proposes d tokens, the verifier
  reads d+1 in one forward, its greedy tokens come back to the host (the acceptance check), a prefix is
  accepted and both caches are cut back. The weights are random, so which prefix is accepted comes from an
  acceptance curve (--acceptance, --conditional or --evaluation FILE): round r accepts the proposals i with
  a_i > u_r, u_r a low-discrepancy sequence in (0, 1), so the tokens per round follow the curve's τ.

How it runs (StaticDecode), as a serving engine decodes: every shape fixed per depth, so each piece is one CUDA
graph, captured before any timing: the verifier's forward per token count d+1 (its all-reduces inside; at tp>1
another without them, for the calibration), the draft's proposal per depth (its first step over the d+1 rows
the verifier read last round, the rows after the accepted ones padding, then d-1 chained steps). The KV caches
have a fixed length; positions, lengths and last round's accepted count are device tensors, and attention
covers the whole cache under a mask made from them on the device. Per round the host copies the verifier's
tokens back (the acceptance check), decides the accepted count and copies the new lengths in: a replay of the
draft's graph, one of the verifier's, two small copies. On a CPU the same code runs uncaptured (the tests);
--no-cuda-graphs decodes eagerly instead, shapes changing every round (the first measurement, issue 19).
Before timing, a few rounds decoded by the graphs are checked against the same code run uncaptured.
Each depth is decoded --decode-repeats times; results.json keeps the median run and the fastest.

What the advisor is fed, measured on the same ranks and link just before the decode, by replaying the same
graphs (or running the same eager code) the decode runs:
- the all-reduce table: worker/allreduce_sweep.py's allreduce_table, the code `longrun hosts
  probe-interconnect` runs on a host, at the probe's sizes and at every message size of this decode;
- verifier_base_ms and verifier_per_token_ms: the verifier's forward without its all-reduces (each rank
  computing only its shard) at 1..max_depth+1 tokens, least squares; the slowest rank's;
- draft_step_ms: the slope of the draft's proposal time over 1..max_depth steps (its intercept, a per-round
  cost, joins verifier_base_ms).

Writes OUT/results.json (every measurement) and, where the advisor imports (server.advisor needs pydantic),
OUT/table.md with predicted and measured tokens/s per depth per link and the depth each picks; it prints the
same. Imports: torch, transformers and safetensors (trainer/model.py), worker/allreduce_sweep.py (stdlib).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.model import DraftConfig, EagleDraft, apply_rotary, load_draft_weights, read_draft_config  # noqa: E402
from trainer.verifier_model import default_layer_ids  # noqa: E402
from worker.allreduce_sweep import DEFAULT_SIZES, allreduce_table  # noqa: E402

# Llama-3-8B's shapes; --layers cuts the depth (the all-reduces per layer are what matters here)
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "num_hidden_layers": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 8192}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 6, "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 2048}
DRAFT_VOCAB = 32000
# P(proposal i accepted | the ones before were): a draft of the kind issue 13 trained holds about this
DEFAULT_CONDITIONAL = 0.85
GOLDEN = (math.sqrt(5) - 1) / 2
LINKS = {"default": {}, "p2p-disabled": {"NCCL_P2P_DISABLE": "1"}}
# --smoke: every piece once, small; options given with it win
SMOKE = ("--max-depth", "3", "--new-tokens", "64", "--repeats", "3", "--decode-repeats", "1", "--sweep-iters", "5")


class TPVerifier:
    """A Llama-shaped decoder, this rank's shard of it, with a KV cache of max_len positions."""

    def __init__(self, config: dict, rank: int, world: int, device: torch.device, dtype: torch.dtype,
                 max_len: int):
        h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        if heads % world or kv % world or config["intermediate_size"] % world:
            raise ValueError(f"heads ({heads}), KV heads ({kv}) and intermediate size must divide by tp={world}")
        self.world, self.eps = world, config["rms_norm_eps"]
        self.head_dim = config.get("head_dim") or h // heads
        self.heads, self.kv_heads, inter = heads // world, kv // world, config["intermediate_size"] // world
        self.capture = default_layer_ids(config["num_hidden_layers"])
        torch.manual_seed(0)

        def weight(*shape: int) -> Tensor:
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        d = self.head_dim
        self.embed = weight(config["vocab_size"], h)
        self.layers = [{
            "ln1": torch.ones(h, device=device, dtype=dtype), "ln2": torch.ones(h, device=device, dtype=dtype),
            "qkv": weight(h, (self.heads + 2 * self.kv_heads) * d), "o": weight(self.heads * d, h),
            "gate_up": weight(h, 2 * inter), "down": weight(inter, h),
        } for _ in range(config["num_hidden_layers"])]
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.lm_head = weight(h, config["vocab_size"])
        cache = (config["num_hidden_layers"], max_len, self.kv_heads, d)
        self.keys = torch.zeros(cache, device=device, dtype=dtype)
        self.values = torch.zeros(cache, device=device, dtype=dtype)
        inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, d, 2, device=device, dtype=torch.float64) / d))
        freqs = torch.arange(max_len, device=device, dtype=torch.float64)[:, None] * inv_freq
        self.cos, self.sin = torch.cat((freqs, freqs), -1).cos().float(), torch.cat((freqs, freqs), -1).sin().float()
        self.key_positions = torch.arange(max_len, device=device)
        self.length = 0

    def forward(self, ids: Tensor, communicate: bool = True) -> tuple[Tensor, Tensor]:
        """Read `ids` [T] after the cached context: (EAGLE-3 features [T, 3H], greedy next token at each [T]).
        Eager: attends to the context's keys only, so shapes change with the context's length."""
        n, start = ids.shape[0], self.length
        positions = torch.arange(start, start + n, device=ids.device)
        self.length = start + n
        return self._forward(ids, positions, start + n, causal_mask(n, start, ids.device), communicate)

    def forward_at(self, ids: Tensor, positions: Tensor, communicate: bool = True) -> tuple[Tensor, Tensor]:
        """Read `ids` [T] at `positions` [T] (a device tensor): static shapes, attention over the whole cache with
        a mask made on the device, so a CUDA graph of it serves every round. self.length is not used."""
        mask = self.key_positions[None, :] <= positions[:, None]
        return self._forward(ids, positions, self.keys.shape[1], mask, communicate)

    def _forward(self, ids: Tensor, positions: Tensor, visible: int, mask: Tensor | None,
                 communicate: bool) -> tuple[Tensor, Tensor]:
        n = ids.shape[0]
        cos, sin = self.cos[positions], self.sin[positions]
        x, captured = self.embed[ids], {}
        for i, layer in enumerate(self.layers):
            captured[i] = x
            q, k, v = (F.rms_norm(x, x.shape[-1:], layer["ln1"], self.eps) @ layer["qkv"]).split(
                [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
            q = apply_rotary(q.view(1, n, self.heads, self.head_dim), cos, sin)
            k = apply_rotary(k.view(1, n, self.kv_heads, self.head_dim), cos, sin)
            self.keys[i].index_copy_(0, positions, k[0])
            self.values[i].index_copy_(0, positions, v.view(n, self.kv_heads, -1))
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), self.keys[i, None, :visible].transpose(1, 2),
                self.values[i, None, :visible].transpose(1, 2), attn_mask=mask, enable_gqa=True)
            x = x + self._reduced(attn[0].transpose(0, 1).reshape(n, -1) @ layer["o"], communicate)
            gate, up = (F.rms_norm(x, x.shape[-1:], layer["ln2"], self.eps) @ layer["gate_up"]).chunk(2, -1)
            x = x + self._reduced((F.silu(gate) * up) @ layer["down"], communicate)
        logits = F.rms_norm(x, x.shape[-1:], self.norm, self.eps) @ self.lm_head
        return torch.cat([captured[i] for i in self.capture], -1), logits.argmax(-1)

    def _reduced(self, partial: Tensor, communicate: bool) -> Tensor:
        # row-parallel output: every rank holds a partial sum of the same activations
        if communicate and self.world > 1:
            dist.all_reduce(partial)
        return partial


def causal_mask(n: int, start: int, device: torch.device) -> Tensor | None:
    """Query i (at position start+i) sees keys 0..start+i; one query sees every cached key."""
    if n == 1:
        return None
    return torch.arange(start + n, device=device)[None, :] <= (start + torch.arange(n, device=device))[:, None]


class DraftRunner:
    """The trainer's EAGLE-3 draft decoding with a KV cache (trainer/model.py's layer, attention by SDPA)."""

    def __init__(self, draft: EagleDraft, max_len: int):
        self.draft = draft
        attn = draft.midlayer.self_attn
        shape = (max_len, attn.kv_heads, attn.head_dim)
        self.keys = torch.zeros(shape, device=draft.d2t.device, dtype=draft.fc.weight.dtype)
        self.values = torch.zeros_like(self.keys)
        self.key_positions = torch.arange(max_len, device=self.keys.device)
        self.length = 0
        self.pending: tuple[Tensor, Tensor] | None = None

    def reset(self) -> None:
        self.length, self.pending = 0, None

    def feed(self, features: Tensor, next_tokens: Tensor) -> None:
        """Positions the verifier accepted: their features [n, 3H] and the token after each [n]."""
        self.pending = (features, next_tokens)

    def _step(self, hidden: Tensor, tokens: Tensor, start: int) -> Tensor:
        n = hidden.shape[0]
        positions = torch.arange(start, start + n, device=hidden.device)
        return self.step(hidden, tokens, positions, start + n, causal_mask(n, start, hidden.device))

    def step_at(self, hidden: Tensor, tokens: Tensor, positions: Tensor) -> Tensor:
        """One step of rows at `positions` (a device tensor) over the whole cache, masked on the device: static
        shapes. A row sees the keys at or before its position; rows after the last valid one (padding) write
        keys that no valid row sees and that the next round's rows overwrite before any row can see them."""
        mask = self.key_positions[None, :] <= positions[:, None]
        return self.step(hidden, tokens, positions, self.keys.shape[0], mask)

    def step(self, hidden: Tensor, tokens: Tensor, positions: Tensor, visible: int, mask: Tensor | None) -> Tensor:
        draft, layer = self.draft, self.draft.midlayer
        attn, n = layer.self_attn, hidden.shape[0]
        qkv = draft.token_qkv(tokens[None])[0] + attn.qkv_hidden(layer.hidden_norm(hidden))
        q, k, v = qkv.split(attn.qkv_sizes, -1)
        cos, sin = draft.rope(positions)
        q = apply_rotary(q.view(1, n, attn.heads, attn.head_dim), cos, sin)
        k = apply_rotary(k.view(1, n, attn.kv_heads, attn.head_dim), cos, sin)
        self.keys.index_copy_(0, positions, k[0])
        self.values.index_copy_(0, positions, v.view(n, attn.kv_heads, -1))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), self.keys[None, :visible].transpose(1, 2),
            self.values[None, :visible].transpose(1, 2), attn_mask=mask, enable_gqa=True)
        hidden = hidden + attn.o_proj(out[0].transpose(0, 1).reshape(n, -1))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def token(self, hidden: Tensor) -> Tensor:
        """The draft's greedy target token id for each row of `hidden`."""
        draft_id = self.draft.logits(hidden).argmax(-1)
        return draft_id + self.draft.d2t[draft_id]

    def propose(self, depth: int) -> Tensor:
        """`depth` target token ids [depth], left on the device: one step over the pending positions (kept in
        the cache), then depth-1 chained steps (their cache entries are overwritten next round)."""
        features, next_tokens = self.pending
        start = self.length
        hidden = self._step(self.draft.fuse(features), next_tokens, start)[-1:]
        self.length = start + features.shape[0]
        proposals = [self.token(hidden)]
        for k in range(1, depth):
            hidden = self._step(hidden, proposals[-1], self.length - 1 + k)
            proposals.append(self.token(hidden))
        return torch.cat(proposals)


def accepted(curve: list[float], depth: int, round_index: int) -> int:
    """Proposals accepted in round `round_index`: those i < depth with a_i > u_r (u_r low-discrepancy)."""
    u = (0.5 + round_index * GOLDEN) % 1.0
    return sum(1 for a in curve[:depth] if a > u)


def replayable(work: Callable[[], None], capture: bool) -> Callable[[], None]:
    """`work` recorded once as a CUDA graph, the returned callable replaying it; `work` itself where capture is
    off (the CPU). Warm-up (on a side stream, as PyTorch's docs ask) and capture run here, outside any timing."""
    if not capture:
        return work
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            work()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


class StaticDecode:
    """The decode with every shape fixed per depth, so that each piece is one CUDA graph on a GPU: per verifier
    token count T = d+1 a forward (with and, at tp>1, without its all-reduces), per depth d the draft's proposal
    (its first step over the d+1 rows the verifier read last round, rows after the accepted ones padding, then
    d-1 chained steps). Nothing in them reads a Python value that changes per round: the context lengths and
    last round's accepted count live in `state` on the device, set from the host between replays.

    Buffers the graphs share: `ids` [last token, proposals...] (the verifier's input, the draft writes the
    proposals), `features` and `greedy` (the verifier's last output, which the draft and the next `last` read)."""

    def __init__(self, verifier: TPVerifier, drafter: DraftRunner, max_depth: int, capture: bool):
        self.verifier, self.drafter = verifier, drafter
        device, width = verifier.embed.device, 3 * verifier.embed.shape[1]
        self.ids = torch.zeros(max_depth + 2, dtype=torch.long, device=device)
        self.features = torch.zeros(max_depth + 1, width, dtype=verifier.embed.dtype, device=device)
        self.greedy = torch.zeros(max_depth + 1, dtype=torch.long, device=device)
        self.rows = torch.arange(max_depth + 1, device=device)
        # verifier length, draft length, proposals accepted last round; pinned so its copy is asynchronous
        self.state = torch.zeros(3, dtype=torch.long, device=device)
        self.host_state = torch.zeros(3, dtype=torch.long, pin_memory=capture)
        tokens = range(1, max_depth + 2)
        self.verify = {(t, True): replayable(lambda t=t: self._verify(t, True), capture) for t in tokens}
        for t in tokens:
            # one rank has nothing to reduce: the forward without all-reduces is the same graph
            self.verify[t, False] = (replayable(lambda t=t: self._verify(t, False), capture)
                                     if verifier.world > 1 else self.verify[t, True])
        self.propose = {d: replayable(lambda d=d: self._propose(d), capture) for d in range(1, max_depth + 1)}

    def set_state(self, verifier_length: int, draft_length: int, accepted_count: int) -> None:
        # the previous copy from host_state has completed: every round waits for the verifier's tokens first
        self.host_state[0], self.host_state[1], self.host_state[2] = verifier_length, draft_length, accepted_count
        self.state.copy_(self.host_state, non_blocking=True)

    def _verify(self, tokens: int, communicate: bool) -> None:
        last_accepted = self.state[2:3]
        ids = torch.cat([self.greedy.index_select(0, last_accepted), self.ids[1:tokens]])
        features, greedy = self.verifier.forward_at(ids, self.state[0] + self.rows[:tokens], communicate)
        self.features[:tokens].copy_(features)
        self.greedy[:tokens].copy_(greedy)

    def _propose(self, depth: int) -> None:
        last_accepted, rows = self.state[2:3], self.rows[:depth + 1]
        # the token after each row the verifier read: accepted proposals, then the verifier's own token
        tokens = torch.where(rows < last_accepted, self.ids[1:depth + 2], self.greedy[:depth + 1])
        hidden = self.drafter.step_at(self.drafter.draft.fuse(self.features[:depth + 1]), tokens,
                                      self.state[1] + rows).index_select(0, last_accepted)
        proposal = self.drafter.token(hidden)
        self.ids[1:2].copy_(proposal)
        for k in range(1, depth):
            hidden = self.drafter.step_at(hidden, proposal, self.state[1:2] + last_accepted + k)
            proposal = self.drafter.token(hidden)
            self.ids[1 + k:2 + k].copy_(proposal)

    def prefill(self, prompt: Tensor) -> None:
        """The prompt through the verifier and all but its last position through the draft (eager, untimed);
        the last position is the first round's pending row, as if the verifier had read it with none accepted."""
        n, positions = prompt.shape[0], torch.arange(prompt.shape[0], device=prompt.device)
        features, greedy = self.verifier.forward_at(prompt, positions)
        self.drafter.step_at(self.drafter.draft.fuse(features[:-1]), prompt[1:], positions[:-1])
        self.features[0].copy_(features[-1])
        self.greedy[0].copy_(greedy[-1])
        self.set_state(n, n - 1, 0)


def decode(verifier: TPVerifier, drafter: DraftRunner, prompt: Tensor, depth: int, new_tokens: int,
           curve: list[float], sync: Callable[[], None], trace: list | None = None) -> dict:
    """Greedy chain speculation at `depth` after `prompt` until new_tokens tokens, eagerly (shapes change every
    round); the prefill is not timed. `trace`, where given, gets each round's record (see round_record)."""
    verifier.length = 0
    drafter.reset()
    features, greedy = verifier.forward(prompt)
    last = greedy[-1:]
    drafter.feed(features, torch.cat([prompt[1:], last]))
    sync()
    started = time.perf_counter()
    generated = rounds = 0
    while generated < new_tokens:
        proposals = drafter.propose(depth) if depth else last[:0]
        context = verifier.length
        features, greedy = verifier.forward(torch.cat([last, proposals]))
        verified = greedy.tolist()  # a real decode compares proposals with these on the host: one sync per round
        a = accepted(curve, depth, rounds)
        verifier.length = context + a + 1
        new = torch.cat([proposals[:a], greedy[a:a + 1]])
        if depth:
            drafter.feed(features[:a + 1], new)
        last = new[-1:]
        if trace is not None:
            trace.append(round_record(proposals, verified, a, features))
        generated += a + 1
        rounds += 1
    sync()
    return decoded(depth, generated, rounds, time.perf_counter() - started)


def decode_static(static: StaticDecode, prompt: Tensor, depth: int, new_tokens: int, curve: list[float],
                  sync: Callable[[], None], trace: list | None = None) -> dict:
    """The same decode through StaticDecode's pieces (graph replays on a GPU). Per round the host does what a
    real decode's does: the verifier's tokens come back (the acceptance check), the accepted count is decided,
    and the device's lengths are set for the next round."""
    static.prefill(prompt)
    verifier_length = prompt.shape[0]
    verify = static.verify[depth + 1, True]
    sync()
    started = time.perf_counter()
    generated = rounds = 0
    while generated < new_tokens:
        if depth:
            static.propose[depth]()
        verify()
        verified = static.greedy[:depth + 1].tolist()
        a = accepted(curve, depth, rounds)
        if trace is not None:
            trace.append(round_record(static.ids[1:depth + 1], verified, a, static.features[:depth + 1]))
        # the draft's next first step starts where the verifier's context stood at this round's start
        static.set_state(verifier_length + a + 1, verifier_length, a)
        verifier_length += a + 1
        generated += a + 1
        rounds += 1
    sync()
    return decoded(depth, generated, rounds, time.perf_counter() - started)


def round_record(proposals: Tensor, verified: list[int], accepted_count: int, features: Tensor) -> dict:
    """One round as a test compares two decodes: the proposals, the verifier's greedy tokens, the tokens the
    round emitted, and the verifier's features (float32, on the host)."""
    proposed = proposals.tolist()
    return {"proposals": proposed, "verified": verified,
            "emitted": proposed[:accepted_count] + verified[accepted_count:accepted_count + 1],
            "features": features.to("cpu", torch.float32, copy=True)}  # a copy: the static buffer changes


def decoded(depth: int, tokens: int, rounds: int, seconds: float) -> dict:
    return {"depth": depth, "tokens": tokens, "rounds": rounds, "seconds": seconds,
            "mean_accepted": tokens / rounds, "tokens_per_second": tokens / seconds}


def timed_ms(work, sync, repeats: int) -> float:
    """Median ms of `work` (synchronised before and after) over `repeats` runs, after one warm-up."""
    work()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        work()
        sync()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def slowest(values: list[float], device: torch.device, world: int) -> list[float]:
    """Each value's maximum over the ranks: a TP round waits for its slowest rank."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure_link(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """Everything of one link on this rank: the all-reduce table, the calibrations, the decode per depth."""
    config, curve = args.config, args.curve
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = args.prompt_tokens + args.new_tokens + 2 * args.max_depth + 8
    verifier = TPVerifier(config, rank, world, device, dtype, max_len)
    drafter = DraftRunner(build_draft(args, verifier.embed, device, dtype), max_len)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    hidden, depths = config["hidden_size"], range(0, args.max_depth + 1)

    table = []
    if world > 1:
        sizes = sorted(set(DEFAULT_SIZES) | {(d + 1) * hidden * 2 for d in depths})
        table = allreduce_table(sizes, iters=args.sweep_iters)

    with torch.inference_mode():
        prompt = torch.randint(0, config["vocab_size"], (args.prompt_tokens,), device=device)
        context = args.prompt_tokens + args.new_tokens // 2
        tokens, steps = [d + 1 for d in depths], list(range(1, args.max_depth + 1))
        if args.path == "eager":
            verify, propose = eager_calibrations(verifier, drafter, prompt, context)
            decode_once = partial(decode, verifier, drafter)
        else:
            started = time.perf_counter()
            static = StaticDecode(verifier, drafter, args.max_depth, capture=args.path == "graphs")
            if rank == 0 and args.path == "graphs":
                print(f"    captured {len(set(static.verify.values())) + len(static.propose)} CUDA graphs in "
                      f"{time.perf_counter() - started:.1f} s", flush=True)
            if args.path == "graphs":
                check_graphs(static, prompt, curve, sync, rank)
            verify, propose = static_calibrations(static, context)
            decode_once = partial(decode_static, static)
        # the calibrations time the same work (the same graphs, on a GPU) as the decode below
        no_comm = slowest([timed_ms(verify(t, False), sync, args.repeats) for t in tokens], device, world)
        with_comm = slowest([timed_ms(verify(t, True), sync, args.repeats) for t in tokens], device, world)
        draft_ms = slowest([timed_ms(propose(d), sync, args.repeats) for d in steps], device, world)
        decodes = []
        for depth in depths:
            runs = [decode_once(prompt, depth, args.new_tokens, curve, sync) for _ in range(args.decode_repeats)]
            decodes.append(summarised(runs))
            if rank == 0:
                print(f"    depth {depth:2d}: {decodes[-1]['tokens_per_second']:8.1f} tokens/s median, "
                      f"{decodes[-1]['tokens_per_second_min_time']:8.1f} fastest run", flush=True)
    return {"allreduce": table, "verifier_ms": {"tokens": tokens, "no_comm": no_comm, "with_comm": with_comm},
            "draft_ms": {"depth": steps, "ms": draft_ms}, "decode": decodes}


def check_graphs(static: StaticDecode, prompt: Tensor, curve: list[float], sync: Callable[[], None],
                 rank: int) -> None:
    """A few rounds decoded by replaying the graphs against the same rounds by the same code run directly: a
    value frozen at capture (a position, a length) would part them at once. Exits before any timing if so."""
    depth = min(3, len(static.propose))
    direct = StaticDecode(static.verifier, static.drafter, len(static.propose), capture=False)
    replayed, called = [], []
    decode_static(static, prompt, depth, 4 * (depth + 1), curve, sync, replayed)
    decode_static(direct, prompt, depth, 4 * (depth + 1), curve, sync, called)
    tokens = [(a["verified"], a["proposals"]) == (b["verified"], b["proposals"]) for a, b in zip(replayed, called,
                                                                                                strict=True)]
    drift = max(float((a["features"] - b["features"]).abs().max() / b["features"].abs().max().clamp_min(1e-6))
                for a, b in zip(replayed, called, strict=True))
    if rank == 0:
        print(f"    graphs against direct calls at depth {depth}: {sum(tokens)}/{len(tokens)} rounds with the same "
              f"tokens, features differ by at most {drift:.2e} of their largest value", flush=True)
    if len(replayed) != len(called) or not all(tokens) or drift > 1e-2:
        raise SystemExit(f"rank {rank}: the CUDA graphs do not decode what the same code does uncaptured "
                         f"(same tokens per round: {tokens}; features differ by {drift:.2e}): not measuring")


def summarised(runs: list[dict]) -> dict:
    """The median run (by time), with the fastest run's tokens/s and every run's seconds beside it."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[len(ordered) // 2], "tokens_per_second_min_time": ordered[0]["tokens_per_second"],
            "runs_seconds": [r["seconds"] for r in runs]}


Calibration = Callable[..., Callable[[], None]]


def eager_calibrations(verifier: TPVerifier, drafter: DraftRunner, prompt: Tensor,
                       context: int) -> tuple[Calibration, Calibration]:
    """(verify(tokens, communicate), propose(depth)): work to time, eagerly, at `context` cached positions."""
    device, width, dtype = prompt.device, verifier.embed.shape[1] * 3, verifier.embed.dtype

    def verify(tokens: int, communicate: bool) -> Callable[[], None]:
        ids = torch.randint(0, verifier.embed.shape[0], (tokens,), device=device)

        def work() -> None:
            verifier.length = context
            verifier.forward(ids, communicate)[1].tolist()
        return work

    def propose(depth: int) -> Callable[[], None]:
        def work() -> None:
            drafter.length = context
            drafter.feed(torch.zeros(2, width, device=device, dtype=dtype), prompt[:2])
            drafter.propose(depth)
        return work
    return verify, propose


def static_calibrations(static: StaticDecode, context: int) -> tuple[Calibration, Calibration]:
    """The same for the static decode: its graphs (or functions) replayed at `context` cached positions; the
    draft's first step covers 2 valid rows, as the eager calibration's does."""

    def verify(tokens: int, communicate: bool) -> Callable[[], None]:
        static.set_state(context, context, 0)
        replay = static.verify[tokens, communicate]

        def work() -> None:
            replay()
            static.greedy[:tokens].tolist()
        return work

    def propose(depth: int) -> Callable[[], None]:
        static.set_state(context, context, 1)
        return static.propose[depth]
    return verify, propose


def build_draft(args: argparse.Namespace, embed: Tensor, device: torch.device, dtype: torch.dtype) -> EagleDraft:
    if args.draft:
        draft_config = read_draft_config(args.draft)
        if draft_config.target_hidden_size != args.config["hidden_size"]:
            raise SystemExit(f"{args.draft} drafts for a verifier of hidden size {draft_config.target_hidden_size}, "
                             f"not {args.config['hidden_size']}: give the verifier's config (--config)")
    else:
        draft_config = DraftConfig.from_verifier(args.config, min(DRAFT_VOCAB, args.config["vocab_size"]), 1)
    torch.manual_seed(1)
    with torch.device(device):
        draft = EagleDraft(draft_config, embed)
    if args.draft:
        load_draft_weights(draft, args.draft)
    inv_freq = draft.inv_freq
    draft.to(device=device, dtype=dtype)
    draft.inv_freq = inv_freq.to(device)  # RoPE frequencies stay fp32
    return draft.eval()


def rank_main(rank: int, args: argparse.Namespace, results) -> None:
    world = args.tp
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # ranks share the cores: one thread each, as one GPU each
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    try:
        measured = measure_link(args, rank, world, device)
        if rank == 0:
            results.put(measured)
    finally:
        if world > 1:
            dist.destroy_process_group()


def run_link(args: argparse.Namespace, link: str) -> dict:
    """One link's measurement in fresh processes: NCCL reads its environment when its communicator starts."""
    import torch.multiprocessing as mp

    saved = dict(os.environ)
    os.environ.update(LINKS[link])
    try:
        context = mp.get_context("spawn")
        results = context.SimpleQueue()
        args.port = _free_port()
        mp.spawn(rank_main, args=(args, results), nprocs=args.tp, join=True)
        return {"link": link, "env": LINKS[link], **results.get()}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def cost_fields(link: dict) -> dict:
    """The advisor's per-round cost parameters from one link's calibration (see the module docstring)."""
    tokens, no_comm = link["verifier_ms"]["tokens"], link["verifier_ms"]["no_comm"]
    # one token runs matrix-vector kernels, off the line through the larger counts: it is fed on its own (the
    # round without speculation), the line through 2.. tokens serves depths >= 1
    several = [(t, ms) for t, ms in zip(tokens, no_comm, strict=True) if t > 1]
    base, per_token = fit_line([t for t, _ in several], [ms for _, ms in several]) if len(several) > 1 else (
        no_comm[0], 0.0)
    draft_base, draft_step = fit_line(link["draft_ms"]["depth"], link["draft_ms"]["ms"])
    # the draft's per-round intercept is paid only in rounds that run the draft (depth >= 1)
    return {"verifier_base_ms": max(base, 1e-3), "verifier_per_token_ms": max(per_token, 0.0),
            "draft_step_ms": max(draft_step, 0.0), "draft_round_ms": max(draft_base, 0.0),
            "verifier_one_token_ms": max(no_comm[tokens.index(1)], 1e-3) if 1 in tokens else None}


def compare(results: dict) -> tuple[list[str], list[dict]]:
    """Predicted (the advisor fed this machine's measurements) against measured tokens/s per depth, per link.
    A link's all-reduce table is the one `longrun hosts probe-interconnect` stored, where given (probe_allreduce),
    else the same sweep run by the decode's own ranks."""
    from server.advisor import CostModel, advise

    config, tp = results["config"], results["tp"]
    evaluation = {"position_acceptance": results["acceptance"][:results["max_depth"]]}
    lines, summary = [], []
    for link in results["links"]:
        rows = link.get("probe_allreduce") or link["allreduce"]
        table = tuple((row["bytes"], row["us"]) for row in rows) or ((1, 0.0),)
        source = "probe-interconnect's stored table" if link.get("probe_allreduce") else "the sweep on these ranks"
        cost = CostModel(tp=tp, allreduce_us=table, layers=config["num_hidden_layers"],
                         hidden=config["hidden_size"], **cost_fields(link))
        label = "nvlink" if link["link"] == "default" else "pcie"
        advice = advise(evaluation, label, tp, cost)
        predicted = {0: advice.no_speculation.tokens_per_second,
                     **{row.depth: row.tokens_per_second for row in advice.by_depth}}
        measured = {row["depth"]: row for row in link["decode"]}
        best = max(measured, key=lambda d: measured[d]["tokens_per_second"])
        picked = advice.recommended_depth
        reached = measured[picked]["tokens_per_second"] / measured[best]["tokens_per_second"]
        errors = {d: predicted[d] / measured[d]["tokens_per_second"] - 1 for d in measured}
        # results.json written before the fastest run was kept has the median only
        fastest = {d: row.get("tokens_per_second_min_time", row["tokens_per_second"]) for d, row in measured.items()}
        errors_fastest = {d: predicted[d] / fastest[d] - 1 for d in measured}
        comm = [(t, w - n, cost.comm_ms(t - 1)) for t, n, w in zip(
            link["verifier_ms"]["tokens"], link["verifier_ms"]["no_comm"], link["verifier_ms"]["with_comm"],
            strict=True)]
        lines += [
            f"### tp={tp}, {link['link']}{' ' + str(link['env']) if link['env'] else ''}", "",
            f"Cost model fed: draft_step_ms {cost.draft_step_ms:.4f}, draft_round_ms {cost.draft_round_ms:.4f}, "
            f"verifier_one_token_ms {cost.verifier_one_token_ms or 0:.4f}, verifier_base_ms {cost.verifier_base_ms:.4f}, "
            f"verifier_per_token_ms {cost.verifier_per_token_ms:.4f}, {cost.layers} layers x 2 all-reduces of "
            f"(d+1) x {cost.hidden} x 2 bytes" + (f"; all-reduce from {source}, {table[0][1]:.1f} µs at "
                                                  f"{table[0][0]} B" if tp > 1 else "; no all-reduce"), "",
            f"Decode: {results.get('decode_path', 'eager')}, median and fastest of "
            f"{results.get('decode_repeats', 3)} runs per depth", "",
            "| depth | τ (curve) | τ (decode) | predicted tokens/s | measured tokens/s | predicted / measured "
            "| fastest run tokens/s | predicted / fastest |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for d in sorted(measured):
            tau = 1.0 if d == 0 else advice.by_depth[d - 1].mean_accepted
            lines.append(f"| {d} | {tau:.2f} | {measured[d]['mean_accepted']:.2f} | {predicted[d]:.1f} | "
                         f"{measured[d]['tokens_per_second']:.1f} | {errors[d]:+.1%} | {fastest[d]:.1f} | "
                         f"{errors_fastest[d]:+.1%} |")
        lines += ["", f"Depth the advisor picks: **{picked}**; best measured: **{best}**; the advisor's depth reaches "
                      f"**{reached:.1%}** of the best measured tokens/s. Largest error: "
                      f"{max(abs(e) for e in errors.values()):.1%} (against the fastest runs: "
                      f"{max(abs(e) for e in errors_fastest.values()):.1%}).", ""]
        if tp > 1:
            lines += ["All-reduce time per verifier forward, measured (with - without) vs the table's:", "",
                      "| tokens | measured ms | from the table ms |", "|---|---|---|"]
            lines += [f"| {t} | {m:.3f} | {p:.3f} |" for t, m, p in comm] + [""]
        summary.append({"link": link["link"], "recommended_depth": picked, "best_measured_depth": best,
                        "reached_of_best": reached, "max_abs_error": max(abs(e) for e in errors.values()),
                        "max_abs_error_fastest": max(abs(e) for e in errors_fastest.values()),
                        "predicted": predicted, "measured": {d: r["tokens_per_second"] for d, r in measured.items()}})
    return lines, summary


def attach_probe_tables(results: dict, items: list[str]) -> None:
    """LINK=FILE: FILE is `GET /v1/hosts/{name}/interconnect` (or the sweep's JSON line) from this machine."""
    for item in items:
        link, _, path = item.partition("=")
        found = [entry for entry in results["links"] if entry["link"] == link]
        if not found or not path:
            raise SystemExit(f"--probe-table wants LINK=FILE with LINK one of the measured links "
                             f"{[entry['link'] for entry in results['links']]}, got {item!r}")
        found[0]["probe_allreduce"] = json.loads(Path(path).read_text())["allreduce"]


def acceptance_curve(args: argparse.Namespace) -> list[float]:
    if args.evaluation:
        curve = json.loads(Path(args.evaluation).read_text())["position_acceptance"]
    elif args.acceptance:
        curve = [float(x) for x in args.acceptance.split(",")]
    else:
        curve = [args.conditional ** (i + 1) for i in range(args.max_depth)]
    if len(curve) < args.max_depth or any(b > a for a, b in zip(curve, curve[1:], strict=False)):
        raise SystemExit(f"the acceptance curve needs {args.max_depth} non-increasing values (P(proposals "
                         f"1..i all accepted)), got {curve}")
    return curve


def verifier_config(args: argparse.Namespace) -> dict:
    config = dict(TINY if args.tiny else LLAMA_8B)
    if args.config:
        config.update(json.loads(Path(args.config).read_text()))
    if args.layers:
        config["num_hidden_layers"] = args.layers
    if config["num_hidden_layers"] < 6:
        raise SystemExit("the verifier needs at least 6 layers (EAGLE-3 captures layers 2, N/2 and N-3)")
    return config


def machine(args: argparse.Namespace) -> str:
    if args.device == "cuda":
        return ", ".join(torch.cuda.get_device_name(i) for i in range(args.tp))
    return f"CPU ({os.cpu_count()} cores)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for results.json and table.md")
    p.add_argument("--compare", type=Path, metavar="RESULTS", help="only compare an earlier results.json")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--links", default=None, help="comma-separated of: default, p2p-disabled (tp>1: both)")
    p.add_argument("--tiny", action="store_true", help="a tiny verifier (smoke runs on a CPU)")
    p.add_argument("--config", help="a Hugging Face config.json for the verifier's shapes")
    p.add_argument("--layers", type=int, help="verifier layers (default 8)")
    p.add_argument("--draft", help="a draft directory saved by the trainer (default: a random draft)")
    p.add_argument("--evaluation", help="an evaluation report; its position_acceptance is the acceptance curve")
    p.add_argument("--acceptance", help="P(proposals 1..i all accepted), comma-separated, non-increasing")
    p.add_argument("--conditional", type=float, default=DEFAULT_CONDITIONAL,
                   help=f"else a geometric curve with this per-proposal acceptance (default {DEFAULT_CONDITIONAL})")
    p.add_argument("--max-depth", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20, help="timings per calibration point (median)")
    p.add_argument("--decode-repeats", type=int, default=5, help="decodes per depth (the median and the fastest)")
    p.add_argument("--sweep-iters", type=int, default=50)
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="decode and calibrate eagerly, shapes changing every round (the measurement before graphs)")
    p.add_argument("--smoke", action="store_true", help=f"a quick run first: {' '.join(SMOKE)}")
    p.add_argument("--probe-table", action="append", default=[], metavar="LINK=FILE",
                   help="compare with the table probe-interconnect stored (GET /v1/hosts/NAME/interconnect saved "
                        "to FILE) for LINK (default or p2p-disabled) instead of this run's own sweep")
    args = p.parse_args(argv)
    if args.smoke:
        args = p.parse_args([*SMOKE, *(argv if argv is not None else sys.argv[1:])])
    if args.compare:
        results = json.loads(args.compare.read_text())
        attach_probe_tables(results, args.probe_table)
        lines, _ = compare(results)
        print("\n".join(lines))
        return 0
    if args.out is None:
        p.error("--out is needed to measure")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        p.error(f"tp={args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
    args.config, args.curve = verifier_config(args), acceptance_curve(args)
    # CUDA graphs where there is CUDA; elsewhere the same static-shape code, uncaptured
    args.path = "eager" if args.no_cuda_graphs else "graphs" if args.device == "cuda" else "static"
    links = args.links.split(",") if args.links else (list(LINKS) if args.tp > 1 else ["default"])
    for item in args.probe_table:
        link, _, path = item.partition("=")
        if link not in links or not Path(path).is_file():
            p.error(f"--probe-table wants LINK=FILE, LINK one of {links} and FILE a saved table, got {item!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(args),
               "torch": torch.__version__, "tp": args.tp, "device": args.device, "decode_path": args.path,
               "decode_repeats": args.decode_repeats, "config": args.config,
               "draft": args.draft or "random", "acceptance": args.curve, "max_depth": args.max_depth,
               "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "links": []}
    for link in links:
        print(f"tp={args.tp}, link {link} {LINKS[link] or ''}", flush=True)
        results["links"].append(run_link(args, link))
        (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    attach_probe_tables(results, args.probe_table)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    try:
        lines, summary = compare(results)
    except ImportError as exc:
        print(f"measured; the advisor does not import here ({exc}): run `python benchmarks/decode_tp.py --compare "
              f"{args.out / 'results.json'}` where longrun is installed")
        return 0
    results["comparison"] = summary
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
