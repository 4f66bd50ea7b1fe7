"""Measure a draft with its verifier: by real greedy speculative decoding, and on held-out dataset text.

    python -m trainer.evaluate --verifier-path V --draft-path O --corpus FILE --max-depth 16

The primary measurement (`measurement: "verifier_greedy_decoding"`, the top-level keys) is what serving
sees: for every prompt, the draft proposes d tokens one after another, chaining its own hidden states;
the verifier checks them in one forward pass (with its KV cache); the longest agreeing prefix plus the
verifier's own next token are accepted, and the next round starts after them. So the text is the
verifier's own greedy text, and every round starts right after a rejection or a full acceptance.

- `position_acceptance[i]`: at max depth, the share of rounds in which draft tokens 0..i are all accepted
  (so it never increases; what the depth advisor takes);
- `conditional_acceptance[i]`: the share of the rounds that reached position i (tokens before it all
  accepted) in which token i is accepted too (0 for a position never reached): how the draft itself holds
  up with depth. `position_acceptance[i]` = Π_{j<=i} `conditional_acceptance[j]`;
- `position_rounds[i]`: how many rounds reached position i (`position_rounds[0]` = `rounds`, every round):
  the sample size behind `conditional_acceptance[i]`;
- `by_depth[d-1].mean_accepted`: τ, tokens per verifier pass at depth d, counted on the rounds of the
  max-depth decoding as if only the first d proposals had been made (= 1 + Σ_{i<d}
  position_acceptance[i]). It never falls with depth and equals the measurement at max depth.
- `by_depth[d-1].measured_accepted`: tokens per pass of a real decoding at depth d. Rounds then start
  elsewhere, so it can differ a little from `mean_accepted` (and is not always monotonic). Only the
  depths of --measure-depths (`all`: every one) and max-depth are decoded, each costing a decoding as
  long again; the others report null.
- `*_interval`: a 90% bootstrap interval (2000 resamples of the prompts with replacement, seed 0):
  rounds of one prompt are not independent, so prompts are the unit. null where a resample never
  reaches the position.

`dataset_text` (`measurement: "dataset_text_teacher_forced"`) holds the same figures on held-out text
as written, cut into samples of --prompt-tokens + --max-new-tokens tokens: a round starts at every
position t whose chain of max-depth targets lies inside the sample; the draft's proposal for token
t+2+k reads the dataset's tokens up to t+1+k (teacher-forced, as in training) and counts as accepted
when it and every earlier one equal the verifier's top-1 at that place. This is training's
`cond_acc_k` on held-out text, with every position a round; on the verifier's own text it equals the
decoding measurement at the positions where decoding rounds start (tested).

Prompts: for chat records, everything before the first assistant token; for plain text, the first
--prompt-tokens tokens of each chunk. The draft recomputes its step-0 pass over the whole context
each round (one layer, cheap next to the verifier) rather than keeping a KV cache.
"""

import argparse
import inspect
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer.corpus import iter_samples
from trainer.model import EagleDraft, TTTCache, load_draft, read_draft_config
from trainer.verifier_model import (
    capture_layers,
    concat_features,
    decoder_layers,
    load_verifier,
    verifier_dtype,
)

GREEDY_MEASUREMENT = "verifier_greedy_decoding"
DATASET_MEASUREMENT = "dataset_text_teacher_forced"
CONFIDENCE = 0.9  # of the bootstrap intervals
RESAMPLES = 2000

# propose(tokens so far x_0..x_n, verifier features of x_0..x_{n-1} [1, n, 3H], depth) -> d target ids
Proposer = Callable[[list[int], Tensor, int], list[int]]


class Verifier:
    """The verifier with a KV cache: greedy next tokens plus the captured features of what it reads."""

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model
        self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)
        self.cache = None
        # transformers 5.x renamed `past_key_values` to `cache`
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def forward(self, tokens: Sequence[int]) -> tuple[Tensor, list[int]]:
        """Read `tokens` after the cached context: (features [1, len, 3H], greedy next token at each)."""
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(tokens)], device=device)
        with capture_layers(self.layers, self.layer_ids) as captured:
            out = self.model(input_ids=ids, use_cache=True, **{self.cache_arg: self.cache})
        self.cache = getattr(out, self.cache_arg)
        features = concat_features(captured, self.layer_ids)
        return features, out.logits[0].argmax(-1).tolist()

    def reset(self) -> None:
        self.cache = None

    def keep(self, length: int) -> None:
        """Drop cached positions from `length` on (the rejected proposals)."""
        surplus = self.cache.get_seq_length() - length
        if surplus > 0:
            self.cache.crop(-surplus)


class DraftProposer:
    """Proposes with the draft exactly as it was trained: step 0 over the context with verifier features,
    then steps 1..d-1 at the last position only, each reading the previous step's hidden state and token."""

    def __init__(self, draft: EagleDraft):
        self.draft = draft

    @torch.no_grad()
    def __call__(self, tokens: list[int], features: Tensor, depth: int) -> list[int]:
        draft = self.draft
        device = draft.d2t.device
        n = features.shape[1]
        with _autocast(device):
            cos, sin = draft.rope(torch.arange(n + depth, device=device))
            cache = TTTCache()
            next_tokens = torch.tensor([tokens[1 : n + 1]], device=device)
            hidden = draft.step(cache, draft.fuse(features.to(draft.fc.weight.dtype)), draft.token_qkv(next_tokens), cos[:n],
                               sin[:n])
            hidden = hidden[:, -1:]
            proposals = []
            for k in range(depth):
                draft_id = int(draft.logits(hidden)[0, -1].argmax())
                proposals.append(draft_id + int(draft.d2t[draft_id]))
                if k + 1 < depth:
                    token_qkv = draft.token_qkv(torch.tensor([[proposals[-1]]], device=device))
                    position = slice(n + k, n + k + 1)  # position n-1, advanced by k+1 steps
                    hidden = draft.step(cache, hidden, token_qkv, cos[position], sin[position])
        return proposals


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


@dataclass
class DecodeStats:
    run_lengths: list[int] = field(default_factory=list)  # per verifier pass: proposals agreeing with it

    @property
    def passes(self) -> int:
        return len(self.run_lengths)

    def mean_accepted(self, depth: int | None = None) -> float:
        """Tokens per pass (agreeing prefix + the verifier's own), counting at most `depth` proposals."""
        cap = depth if depth is not None else max(self.run_lengths, default=0)
        return sum(min(n, cap) + 1 for n in self.run_lengths) / max(self.passes, 1)

    def position_acceptance(self, depth: int) -> list[float]:
        """P(proposals 0..i all accepted) per round, for i < depth."""
        return [sum(n > i for n in self.run_lengths) / max(self.passes, 1) for i in range(depth)]

    def conditional_acceptance(self, depth: int) -> list[float]:
        """P(proposal i accepted | proposals before it were), for i < depth."""
        reached = [sum(n >= i for n in self.run_lengths) for i in range(depth)]
        accepted = [sum(n > i for n in self.run_lengths) for i in range(depth)]
        return [a / r if r else 0.0 for a, r in zip(accepted, reached, strict=True)]


def speculative_decode(
    verifier: Verifier, propose: Proposer, prompt: Sequence[int], depth: int, max_new_tokens: int,
    eos_token_id: int | None, stats: DecodeStats,
) -> list[int]:
    """Greedy speculative decoding of one prompt; adds to `stats`, returns the generated tokens."""
    verifier.reset()
    features, greedy = verifier.forward(prompt)
    tokens = [*prompt, greedy[-1]]  # the last token is not read by the verifier yet
    while len(tokens) - len(prompt) < max_new_tokens and tokens[-1] != eos_token_id:
        proposals = propose(tokens, features, depth)
        new_features, greedy = verifier.forward([tokens[-1], *proposals])
        agree = 0
        while agree < depth and proposals[agree] == greedy[agree]:
            agree += 1
        stats.run_lengths.append(agree)
        features = torch.cat([features, new_features[:, : agree + 1]], dim=1)
        verifier.keep(features.shape[1])
        tokens += [*proposals[:agree], greedy[agree]]
        if eos_token_id in tokens[len(prompt) :]:
            tokens = tokens[: tokens.index(eos_token_id, len(prompt)) + 1]
    return tokens[len(prompt) :]


def corpus_prompts(tokenizer, corpus: Path, max_samples: int, prompt_tokens: int) -> list[list[int]]:
    """Chat records: everything before the first trained (assistant) token; text: the first prompt_tokens."""
    prompts = []
    for ids, mask in iter_samples(tokenizer, corpus, max(4 * prompt_tokens, 256)):
        first_trained = next((i for i, m in enumerate(mask) if m), len(ids))
        prompts.append(ids[:first_trained] if 0 < first_trained < len(ids) else ids[:prompt_tokens])
        if len(prompts) == max_samples:
            break
    return prompts


def acceptance_summary(
    runs_by_prompt: Sequence[Sequence[int]], max_depth: int, confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES, seed: int = 0,
) -> dict:
    """τ by depth, acceptance at each position and given the earlier ones, the rounds that reached each
    position, and a bootstrap interval of each figure over prompts (resampled with replacement).

    `runs_by_prompt[p]`: for every round (verifier pass) of prompt p, how many proposals were accepted."""
    depths = torch.arange(max_depth)

    def prompt_counts(runs: Sequence[int]) -> Tensor:
        """[rounds, accepted at position i (run > i) for each i, reached position i (run >= i) for each i]."""
        accepted = torch.tensor(runs, dtype=torch.long).reshape(-1, 1)
        return torch.cat([torch.tensor([len(runs)]), (accepted > depths).sum(0), (accepted >= depths).sum(0)])

    counts = torch.stack([prompt_counts(runs) for runs in runs_by_prompt]).double()

    def figures(totals: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rounds, accepted, reached = totals[..., :1], totals[..., 1 : max_depth + 1], totals[..., max_depth + 1 :]
        position = accepted / rounds.clamp(min=1)
        return position, accepted / reached, 1 + position.cumsum(-1)  # conditional is nan where never reached

    total = counts.sum(0)
    position, conditional, taus = figures(total)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(runs_by_prompt), (resamples, len(runs_by_prompt)), generator=generator)
    weights = torch.zeros(resamples, len(runs_by_prompt), dtype=torch.float64).scatter_add_(
        1, picks, torch.ones_like(picks, dtype=torch.float64))
    tails = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64)
    bounds = [torch.nanquantile(f, tails, dim=0).T for f in figures(weights @ counts)]

    def interval(bound: Tensor) -> list[float] | None:
        return None if bound.isnan().any() else [round(float(b), 4) for b in bound]

    position_bounds, conditional_bounds, tau_bounds = bounds
    return {
        "by_depth": [{"depth": d + 1, "mean_accepted": float(taus[d]), "mean_accepted_interval": interval(tau_bounds[d])}
                     for d in range(max_depth)],
        "position_acceptance": position.tolist(),
        "position_acceptance_interval": [interval(b) for b in position_bounds],
        "conditional_acceptance": conditional.nan_to_num(0.0).tolist(),
        "conditional_acceptance_interval": [interval(b) for b in conditional_bounds],
        "position_rounds": [int(r) for r in total[max_depth + 1 :]],
        "rounds": int(total[0]),
        "prompts": len(runs_by_prompt),
    }


def evaluate(
    verifier: Verifier, propose: Proposer, prompts: Sequence[Sequence[int]], max_depth: int, max_new_tokens: int,
    eos_token_id: int | None, measure_depths: Sequence[int] | None = None,
) -> dict:
    """The acceptance report on the verifier's own greedy text (see the module docstring), from real
    decoding at max_depth and at each of `measure_depths` (default: every depth 1..max_depth)."""
    depths = range(1, max_depth + 1) if measure_depths is None else {d for d in measure_depths if 0 < d < max_depth}
    measured: dict[int, DecodeStats] = {}
    deepest_by_prompt: list[list[int]] = []
    for depth in sorted({*depths, max_depth}):
        measured[depth] = DecodeStats()
        for prompt in prompts:
            stats = DecodeStats()
            speculative_decode(verifier, propose, prompt, depth, max_new_tokens, eos_token_id, stats)
            measured[depth].run_lengths += stats.run_lengths
            if depth == max_depth:
                deepest_by_prompt.append(stats.run_lengths)
    report = {"measurement": GREEDY_MEASUREMENT, **acceptance_summary(deepest_by_prompt, max_depth)}
    for row in report["by_depth"]:
        depth = row["depth"]
        row["measured_accepted"] = measured[depth].mean_accepted() if depth in measured else None
        row["verifier_passes"] = measured[depth].passes if depth in measured else None
    return report


@torch.no_grad()
def teacher_forced_runs(
    verifier: Verifier, draft: EagleDraft, samples: Sequence[tuple[list[int], list[int]]], max_depth: int
) -> list[list[int]]:
    """Per sample of dataset text, a round at every position t whose chain fits in it: how many of the
    draft's proposals for tokens t+2.. match the verifier's top-1 there, reading the dataset's tokens
    (docs/trainer.md's TTT chain, as training's `cond_acc_k` counts it on the validation split)."""
    device = draft.d2t.device
    runs_by_sample = []
    for ids, mask in samples:
        length = len(ids)
        if length < max_depth + 3:
            continue
        starts = range(length - 1 - max_depth)  # the whole chain's targets lie inside the sample
        verifier.reset()
        features, greedy = verifier.forward(ids)
        verifier.reset()
        with _autocast(device):
            token_qkv = draft.token_qkv(F.pad(torch.tensor([ids[1:]], device=device), (0, max_depth)))
            cos, sin = draft.rope(torch.arange(length + max_depth - 1, device=device))
            cache, hidden = TTTCache(), draft.fuse(features.to(device, draft.fc.weight.dtype))
            agree = []
            for k in range(max_depth):
                hidden = draft.step(cache, hidden, token_qkv[:, k : k + length], cos[k : k + length],
                                    sin[k : k + length])
                draft_ids = draft.logits(hidden)[0].argmax(-1)
                proposals = (draft_ids + draft.d2t[draft_ids]).tolist()
                # position t's step k proposes token t+2+k, which the verifier predicts at position t+1+k
                agree.append([proposals[t] == greedy[t + 1 + k] and mask[t + 2 + k] == 1 for t in starts])
        runs = [next((k for k in range(max_depth) if not agree[k][t]), max_depth) for t in starts if mask[t + 2]]
        if runs:
            runs_by_sample.append(runs)
    return runs_by_sample


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier-path", required=True)
    p.add_argument("--draft-path", required=True, help="a training output dir (or checkpoint) with model.safetensors")
    p.add_argument("--corpus", required=True, type=Path, help="plain text, or JSONL with `text` or chat `messages`")
    p.add_argument("--max-depth", type=int, default=16)
    p.add_argument("--max-samples", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length taken from plain-text samples")
    p.add_argument("--measure-depths", default=[],
                   type=lambda v: None if v == "all" else [int(x) for x in v.split(",") if x.strip()],
                   help="comma-separated depths to decode for real besides max-depth, or `all` (default: none)")
    p.add_argument("--output", type=Path, help="also write the JSON report here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.max_depth < 1 or args.max_samples < 1 or args.max_new_tokens < 1:
        p.error("--max-depth, --max-samples and --max-new-tokens must be at least 1")
    return args


def evaluate_draft(verifier_path: str, draft_path: str, corpus: Path, max_depth: int = 16, max_samples: int = 16,
                   max_new_tokens: int = 128, prompt_tokens: int = 64, device: str | None = None,
                   measure_depths: Sequence[int] | None = ()) -> dict:
    """Load the verifier and the draft, decode held-out prompts at max_depth (and at `measure_depths`, None: every
    depth), measure on the held-out text as written, return the acceptance report."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = verifier_dtype(verifier_path, dev)
    model, tokenizer = load_verifier(verifier_path, dev, dtype)
    embed = model.get_input_embeddings().weight.detach()
    if dev.type == "cpu":  # the draft computes in float32 there (no autocast), the verifier maybe in bf16
        embed = embed.float()
    draft = load_draft(draft_path, embed).to(dev).eval()
    prompts = corpus_prompts(tokenizer, corpus, max_samples, prompt_tokens)
    if not prompts:
        raise SystemExit(f"no prompts in {corpus}")
    verifier = Verifier(model, read_draft_config(draft_path).aux_hidden_state_layer_ids)
    report = evaluate(verifier, DraftProposer(draft), prompts, max_depth, max_new_tokens, tokenizer.eos_token_id,
                      measure_depths)
    samples = list(itertools.islice(iter_samples(tokenizer, corpus, prompt_tokens + max_new_tokens), max_samples))
    dataset_runs = teacher_forced_runs(verifier, draft, samples, max_depth)
    dataset = acceptance_summary(dataset_runs, max_depth) if dataset_runs else {}
    report.update(samples=len(prompts), max_new_tokens=max_new_tokens, draft_ttt_steps=draft.config.ttt_steps,
                  interval={"confidence": CONFIDENCE, "resamples": RESAMPLES, "over": "prompts"},
                  dataset_text={"measurement": DATASET_MEASUREMENT, "sample_tokens": prompt_tokens + max_new_tokens,
                                **dataset})
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = evaluate_draft(args.verifier_path, args.draft_path, args.corpus, args.max_depth, args.max_samples,
                            args.max_new_tokens, args.prompt_tokens, args.device, args.measure_depths)
    text = json.dumps(report)
    if args.output:
        args.output.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
