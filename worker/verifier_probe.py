"""One decoder layer of a verifier's shape, timed on this host's GPU at 1..16 query tokens: what `longrun hosts
probe-verifier HOST --config PATH --tp N [--ep E]` runs there (hostside's `verifier` verb installs it under the
workspace's .longrun/bin).

    python verifier_probe.py --config PATH [--tp 8] [--ep 1] [--tokens 16] [--context 4096]

Runs with the host's python that has torch; it imports nothing of longrun. It reads PATH (a config.json or the model
directory holding one), builds on GPU 0 one rank's share of a dense layer and of an MoE layer of that shape (1/tp
of every matrix; under ep = tp, E/ep whole experts) with random weights of the checkpoint's dtype (bf16; fp8 by
torch._scaled_mm; int4 by torch._weight_int4pack_mm where this torch has it, else bf16 and the answer says so),
attends over a KV cache of --context tokens, and times each token count as a replayed CUDA graph (median of 20
replays of 10), so kernel launches cost what they cost in a serving engine's captured decode. Routing is uniform
random, so n tokens touch the experts they would on average. Collectives are not run: the all-reduce table prices
them. Its kernels are torch's: MLA's absorbed attention as multi-query GEMMs over the shared latent (FlashMLA's
arithmetic, not its one kernel), bf16 experts as one grouped GEMM (torch._grouped_mm, a fused MoE's), int4 and fp8
experts one matmul per expert touched (torch has no grouped kernel for them; `moe_kernel` says which): an upper
bound on an engine's layer. The figures below are from the probe before 2026-12-07, whose MLA attention ran SDPA
over the latent expanded to every head (0.44 ms of the 0.45 ms dense layer). On one H200 (torch 2.11, int4 by tinygemm, 4096 tokens of
context) a Kimi-K2.5 MoE layer's tp=8 share took 0.59 ms at 1 token and 2.73 ms at 16 (ep=8: 0.46 and 0.84), its
dense layer 0.45 ms; a Llama-3-70B layer's tp=8 share 0.085 ms at 1 token and 0.135-0.138 ms at 2-16
(tests/fixtures/verifier-probe).

Prints one JSON line: {"path", "config", "tp", "ep", "gpu", "dtype", "tokens", "dense_ms", "moe_ms"} or, when it
cannot measure (no torch, no GPU), {"error"} with exit status 3.
"""

from __future__ import annotations  # hosts may run Python 3.8

import argparse
import itertools
import json
import os
import socket
import statistics
import sys

CANNOT_MEASURE = 3


def read_config(path: str) -> dict:
    file = path if path.endswith(".json") else os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    text = config.get("text_config") or config.get("language_config")
    return {**config, **text} if isinstance(text, dict) else config


def weight_kind(config: dict) -> str:
    qc = config.get("quantization_config") or {}
    method = str(qc.get("quant_method") or "").lower()
    if method == "fp8":
        return "fp8"
    groups = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    bits = qc.get("bits") or qc.get("w_bit") or next((w.get("num_bits") for w in groups if w), None)
    return "int4" if bits == 4 else "fp8" if bits == 8 and method == "compressed-tensors" else "bf16"


class Linear:
    """y = x @ W for one rank's slice, in the checkpoint's dtype where torch has a kernel for it."""

    made: list = []  # every one built, to say which dtypes ran

    def __init__(self, torch, n_in: int, n_out: int, kind: str, device):
        self.torch, self.kind = torch, kind
        Linear.made.append(self)
        if kind == "int4":
            try:
                w = torch.randint(0, 16, (n_out, n_in), dtype=torch.int32, device=device)
                packed = (w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8)
                self.w = torch._convert_weight_to_int4pack(packed, 8)
                self.scales = torch.randn(n_in // 32, n_out, 2, dtype=torch.bfloat16, device=device)
                self(torch.randn(1, n_in, dtype=torch.bfloat16, device=device))
                return
            except (AttributeError, RuntimeError):
                self.kind = "bf16"
        if self.kind == "fp8":
            self.w = torch.randn(n_out, n_in, device=device).to(torch.float8_e4m3fn).t()
            self.one = torch.ones((), device=device)
        else:
            self.w = torch.randn(n_in, n_out, dtype=torch.bfloat16, device=device) * 0.01

    def __call__(self, x):
        torch = self.torch
        if self.kind == "int4":
            return torch._weight_int4pack_mm(x, self.w, 32, self.scales)
        if self.kind == "fp8":
            return torch._scaled_mm(x.to(torch.float8_e4m3fn), self.w, scale_a=self.one, scale_b=self.one,
                                    out_dtype=torch.bfloat16)
        return x @ self.w


def build_layer(torch, c: dict, tp: int, ep: int, moe: bool, context: int, kind: str, tokens: int, dev=None):
    """A closure running one layer's forward over `tokens` tokens (one rank's share); on GPU 0 unless `dev`."""
    dev = dev if dev is not None else torch.device("cuda", 0)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    hp = max(1, heads // tp)
    bf = torch.bfloat16
    attn_kind = "bf16"  # attention, shared experts and dense MLPs stay unquantized in the int4 releases
    if c.get("kv_lora_rank"):
        ql, kvl, rope = c.get("q_lora_rank") or 0, c["kv_lora_rank"], c["qk_rope_head_dim"]
        vd = c.get("v_head_dim", 128)
        q_a = Linear(torch, h, ql, attn_kind, dev) if ql else None
        q_b = Linear(torch, ql or h, hp * (kvl + rope), attn_kind, dev)  # absorbed: q in the latent space
        kv_a = Linear(torch, h, kvl + rope, attn_kind, dev)
        latent = torch.randn(1, 1, context + tokens, kvl + rope, dtype=bf, device=dev)
        v_b = torch.randn(hp, kvl, vd, dtype=bf, device=dev) * 0.01
        o = Linear(torch, hp * vd, h, attn_kind, dev)

        keys, scale = latent[0, 0], (c.get("qk_nope_head_dim", 128) + rope) ** -0.5

        def attention(x):
            # absorbed MLA is multi-query attention over one shared latent head: every head's and token's query
            # against the latent cache as one GEMM, its softmax, one GEMM against the latent values (what
            # FlashMLA computes in one kernel); SDPA over the latent expanded to every head took 0.44 ms a layer
            q = q_b(q_a(x) if q_a else x).view(tokens * hp, kvl + rope)
            kv_a(x)
            weights = torch.softmax((q @ keys.t()).float() * scale, -1).to(bf)
            a = (weights @ keys[:, :kvl]).view(tokens, hp, kvl).transpose(0, 1)
            return o(torch.bmm(a, v_b).transpose(0, 1).reshape(tokens, hp * vd))
    else:
        hd = c.get("head_dim") or h // heads
        kvp = max(1, c.get("num_key_value_heads", heads) // tp)
        qkv = Linear(torch, h, (hp + 2 * kvp) * hd, attn_kind, dev)
        cache_k = torch.randn(1, hp, context + tokens, hd, dtype=bf, device=dev)
        o = Linear(torch, hp * hd, h, attn_kind, dev)

        def attention(x):
            q = qkv(x)[:, :hp * hd].reshape(1, tokens, hp, hd).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, cache_k, cache_k)
            return o(a.transpose(1, 2).reshape(tokens, hp * hd))

    experts = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0
    if moe and experts:
        k = c["num_experts_per_tok"]
        inter = c.get("moe_intermediate_size") or c["intermediate_size"]
        local, width = (experts // ep, inter) if ep > 1 else (experts, max(1, inter // tp))
        grouped = grouped_experts(torch, local, h, width, kind, dev)
        ups = [Linear(torch, h, 2 * width, kind, dev) for _ in range(local)] if grouped is None else []
        downs = [Linear(torch, width, h, kind, dev) for _ in range(local)] if grouped is None else []
        shared_w = (c.get("n_shared_experts") or 0) * inter or c.get("shared_expert_intermediate_size") or 0
        shared = [Linear(torch, h, 2 * max(1, shared_w // tp), attn_kind, dev),
                  Linear(torch, max(1, shared_w // tp), h, attn_kind, dev)] if shared_w else None
        router = Linear(torch, h, experts, "bf16", dev)
        gen = torch.Generator().manual_seed(tokens)
        picks = [torch.randperm(experts, generator=gen)[:k].tolist() for _ in range(tokens)]
        # this rank's experts: under ep the first E/ep; under tp a slice of every one
        routed: dict = {}
        for t, chosen in enumerate(picks):
            for e in chosen:
                if ep == 1 or e < local:
                    routed.setdefault(e % local, []).append(t)

        # token indices live on the GPU: a captured graph cannot copy from the host
        rows_of = {e: torch.tensor(rows, device=dev) for e, rows in routed.items()}

        if grouped is not None:  # the touched experts' rows in expert order, one grouped GEMM each way
            order = sorted(rows_of)
            rows_all = torch.cat([rows_of[e] for e in order]) if order else torch.zeros(0, dtype=torch.long, device=dev)
            offsets = torch.tensor(list(itertools.accumulate(len(routed[e]) for e in order)), dtype=torch.int32,
                                   device=dev)
            # the rows taken from the weights' storage order, so the copies keep the layout the kernel was tried on
            up_w = grouped[0].transpose(1, 2)[order].transpose(1, 2)
            down_w = grouped[1].transpose(1, 2)[order].transpose(1, 2)

        def mlp(x):
            router(x)
            out = torch.zeros_like(x)
            if grouped is not None and order:
                g = torch._grouped_mm(x.index_select(0, rows_all), up_w, offs=offsets)
                y = torch._grouped_mm(torch.nn.functional.silu(g[:, :width]) * g[:, width:], down_w, offs=offsets)
                out.index_add_(0, rows_all, y)
            for e, rows in rows_of.items() if grouped is None else ():
                g = ups[e](x.index_select(0, rows))
                out.index_add_(0, rows, downs[e](torch.nn.functional.silu(g[:, :g.shape[1] // 2])
                                                 * g[:, g.shape[1] // 2:]))
            if shared:
                g = shared[0](x)
                out += shared[1](torch.nn.functional.silu(g[:, :g.shape[1] // 2]) * g[:, g.shape[1] // 2:])
            return out
    else:
        inter = max(1, c["intermediate_size"] // tp)
        up, down = Linear(torch, h, 2 * inter, attn_kind if experts else kind, dev), Linear(
            torch, inter, h, attn_kind if experts else kind, dev)

        def mlp(x):
            g = up(x)
            return down(torch.nn.functional.silu(g[:, :inter]) * g[:, inter:])

    x = torch.randn(tokens, h, dtype=bf, device=dev)
    return lambda: mlp(attention(x))


def grouped_experts(torch, local: int, h: int, width: int, kind: str, dev):
    """(up [E, h, 2w], down [E, w, h]) bf16 weights for torch._grouped_mm, a fused MoE's one GEMM over every
    touched expert, where the checkpoint is bf16 and this torch and GPU run it; None: one matmul per expert (int4 and
    fp8 have no grouped kernel in torch: the loop's launches are the probe's stated excess over an engine's)."""
    if kind != "bf16" or not hasattr(torch, "_grouped_mm"):
        return None
    try:
        up = torch.randn(local, 2 * width, h, dtype=torch.bfloat16, device=dev).transpose(1, 2) * 0.01
        down = torch.randn(local, h, width, dtype=torch.bfloat16, device=dev).transpose(1, 2) * 0.01
        x = torch.randn(16, h, dtype=torch.bfloat16, device=dev)
        torch._grouped_mm(x, up[:1], offs=torch.tensor([16], dtype=torch.int32, device=dev))
        return up, down
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def time_ms(torch, forward, replays: int = 20, per_replay: int = 10) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_replay):
            forward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_replay)
    return statistics.median(times)


def measure(config_path: str, tp: int, ep: int, max_tokens: int, context: int) -> dict:
    try:
        import torch
    except ImportError:
        return {"error": f"no torch in {sys.executable} on {socket.gethostname()}"}
    if not torch.cuda.is_available():
        return {"error": f"no GPU on {socket.gethostname()}: torch.cuda.is_available() is false"}
    c = read_config(config_path)
    kind = weight_kind(c)
    tokens = list(range(1, max_tokens + 1))
    experts = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0
    answer = {"path": config_path, "config": c, "tp": tp, "ep": ep, "gpu": torch.cuda.get_device_name(0),
              "tokens": tokens, "context": context}
    used = set()
    answer["moe_kernel"] = ("one grouped GEMM over the touched experts (torch._grouped_mm)"
                            if experts and grouped_experts(torch, 1, 64, 64, kind, torch.device("cuda", 0)) is not None
                            else "one matmul per expert touched (no grouped kernel in torch for this dtype)")
    with torch.inference_mode():
        for moe, key in ((False, "dense_ms"), (True, "moe_ms")):
            if moe and not experts:
                continue
            answer[key] = []
            for n in tokens:
                Linear.made.clear()
                forward = build_layer(torch, c, tp, ep, moe, context, kind, n)
                used |= {linear.kind for linear in Linear.made}
                answer[key].append(round(time_ms(torch, forward), 4))
                del forward
                Linear.made.clear()
                torch.cuda.empty_cache()
    answer["dtype"] = kind if kind in used else f"bf16 (no torch {kind} kernel here: an upper bound)"
    return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args(argv)
    try:
        answer = measure(args.config, args.tp, args.ep, args.tokens, args.context)
    except (OSError, ValueError, KeyError) as exc:
        answer = {"error": f"cannot read {args.config}: {exc}"}
    print(json.dumps(answer))
    return CANNOT_MEASURE if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
