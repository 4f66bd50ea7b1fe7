"""Everything the trainer reads from the verifier, in one place: its config, the feature-capture hook, and
the few tensors the draft needs.

- `read_verifier_config`, `default_layer_ids`: the verifier's config.json and the layers EAGLE-3 captures.
- `load_verifier`, `decoder_layers`, `capture_layers`, `capture_hidden_states`: the verifier as a transformers
  model (on one device, or spread over every GPU with `device_map="auto"`) and the one hook that captures the
  inputs of chosen layers (and the last layer's output) during its forward pass. `prepare` and `evaluate`
  both capture through it, so training and evaluation features come from the same code.
- `load_verifier_head`: the token embedding (frozen into the draft), the final norm and the lm_head (which
  turn a captured last hidden state into target distributions), read straight from the safetensors files.
  The verifier itself is never instantiated for that: a trillion-parameter verifier must not be loaded to
  train its draft. Quantized checkpoints work when those three tensors are stored unquantized, as the int4
  releases of large MoE models store them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import Tensor

from trainer.vocab import draft_to_target_ids, target_to_draft_ids

# Tensor-name endings that quantization schemes store in place of (or next to) a module's `weight`:
# compressed-tensors (weight_packed, weight_scale, ...), GPTQ/AWQ (qweight, qzeros, scales, g_idx), FP8 (weight_scale_inv).
QUANTIZED_SUFFIXES = (
    "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_global_scale",
    "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx",
)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

if TYPE_CHECKING:  # transformers' models are imported where a verifier is loaded: training never loads one, and
    # importing them (with torch._dynamo and DTensor behind them) took each rank ~5 s of its start-up
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def read_verifier_config(verifier_path: str | Path) -> dict:
    """The verifier's config.json; multimodal wrappers are unwrapped to their text model's config."""
    path = Path(verifier_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --verifier-path must be a Hugging Face model directory")
    config = json.loads(path.read_text())
    text = config.get("text_config") or config.get("language_config")
    if text:
        config = {**config, **text}
    if config.get("tie_word_embeddings") is None:
        config["tie_word_embeddings"] = False
    return config


def verifier_dtype(verifier_path: str | Path, device: str | torch.device) -> torch.dtype:
    """The dtype the verifier runs in (prepare, regenerate, evaluate alike): bf16 on a GPU, as served; on the CPU
    bf16 where the checkpoint is stored in bf16 and the CPU has bf16 instructions (SmolLM2-135M's prefill cost 3.3x
    fewer CPU-seconds than in float32 on an AVX512-BF16 Xeon), else float32 (the demo's toy verifier, stored so)."""
    if torch.device(device if str(device) != "auto" else "cuda").type != "cpu":
        return torch.bfloat16
    config = read_verifier_config(verifier_path)
    stored = config.get("dtype") or config.get("torch_dtype")
    fast = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(
        torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return torch.bfloat16 if stored == "bfloat16" and fast else torch.float32


def default_layer_ids(num_layers: int) -> list[int]:
    """Inputs of layers 2, N//2 and N-3: low, middle and high features, as in EAGLE-3 (and vLLM's and SGLang's default)."""
    return [2, num_layers // 2, num_layers - 3]


def _tensor_files(verifier_path: Path) -> dict[str, Path]:
    index = verifier_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: verifier_path / file for name, file in weight_map.items()}
    files = sorted(verifier_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {verifier_path}")
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _modules_named(names: dict[str, Path], module: str) -> list[str]:
    """Modules (tensor names less their last part) that are `module` or end in `.module`, shortest first
    (`model.norm` before a vision tower's `...model.norm`)."""
    prefixes = {name.rsplit(".", 1)[0] for name in names if "." in name}
    return sorted((p for p in prefixes if p == module or p.endswith("." + module)), key=len)


def _unquantized_weight(names: dict[str, Path], module: str, verifier_path: Path) -> str | None:
    """The name of `module`'s plain floating-point weight; a clear error when the checkpoint stores it quantized."""
    for prefix in _modules_named(names, module):
        quantized = sorted(f"{prefix}.{suffix}" for suffix in QUANTIZED_SUFFIXES if f"{prefix}.{suffix}" in names)
        weight = f"{prefix}.weight"
        if not quantized and weight in names:
            with safe_open(str(names[weight]), framework="pt") as f:
                dtype = f.get_slice(weight).get_dtype()
            if dtype in ("F32", "F16", "BF16", "F64"):
                return weight
            quantized = [f"{weight} ({dtype})"]
        if quantized:
            raise ValueError(
                f"the verifier's {prefix} is stored quantized in {verifier_path} ({', '.join(quantized)}): the draft "
                f"needs the embedding, the final norm and the lm_head in floating point. Write an unquantized "
                f"`{weight}` (bf16) into the checkpoint (dequantize it, or copy it from the model's bf16 release) "
                "and list it in model.safetensors.index.json; the other layers may stay quantized."
            )
    return None


def read_verifier_tensors(verifier_path: str | Path) -> dict[str, Tensor]:
    """`embed_tokens`, `norm` and `lm_head` weights (lm_head is the embedding when they are tied)."""
    verifier_path = Path(verifier_path)
    names = _tensor_files(verifier_path)
    wanted = {
        "embed_tokens": _unquantized_weight(names, "embed_tokens", verifier_path),
        "norm": _unquantized_weight(names, "model.norm", verifier_path) or _unquantized_weight(names, "norm", verifier_path),
        "lm_head": _unquantized_weight(names, "lm_head", verifier_path),
    }
    for key in ("embed_tokens", "norm"):
        if wanted[key] is None:
            raise KeyError(f"no tensor named *{key}.weight in {verifier_path}; is this a causal LM checkpoint?")
    tensors = {}
    for key, name in wanted.items():
        if name is not None:
            with safe_open(str(names[name]), framework="pt") as f:
                tensors[key] = f.get_tensor(name)
    tensors.setdefault("lm_head", tensors["embed_tokens"])
    return tensors


@dataclass
class VerifierHead:
    """The verifier's final norm and lm_head, plus the draft-vocabulary maps the targets need."""

    norm_weight: Tensor  # [H]
    norm_eps: float
    lm_head_weight: Tensor  # [V, H]
    draft_ids: Tensor  # [K] target id of each draft id
    target_to_draft: Tensor  # [V] draft id of each target id, -1 if absent
    input_is_normed: bool = False  # the stored last hidden state is already after the final norm (SpecForge's)

    @cached_property
    def draft_rows(self) -> Tensor:
        """[K, H] the lm_head's rows of the draft vocabulary, copied once, where the head is used."""
        return self.lm_head_weight[self.draft_ids.to(self.lm_head_weight.device)]

    def to(self, device: torch.device | str, dtype: torch.dtype) -> VerifierHead:
        return VerifierHead(
            self.norm_weight.to(device, torch.float32),
            self.norm_eps,
            self.lm_head_weight.to(device, dtype),
            self.draft_ids.to(device),
            self.target_to_draft.to(device),
            self.input_is_normed,
        )

    def logits(self, last_hidden_state: Tensor) -> Tensor:
        """Verifier logits over the full vocabulary from its last decoder layer's output (before norm)."""
        return self._normed(last_hidden_state) @ self.lm_head_weight.T

    def draft_logits(self, last_hidden_state: Tensor) -> Tensor:
        """The same logits, only at the draft vocabulary's ids (`logits(x)[:, draft_ids]`)."""
        return self._normed(last_hidden_state) @ self.draft_rows.T

    def _normed(self, last_hidden_state: Tensor) -> Tensor:
        x = last_hidden_state.float()
        if not self.input_is_normed:
            x = torch.nn.functional.rms_norm(x, (x.shape[-1],), self.norm_weight, self.norm_eps)
        return x.to(self.lm_head_weight.dtype)


def load_verifier_head(verifier_path: str | Path, d2t: Tensor, t2d: Tensor) -> tuple[VerifierHead, Tensor]:
    """(the head that computes targets, the embedding weight [V, H] to freeze into the draft), on the CPU."""
    config = read_verifier_config(verifier_path)
    tensors = read_verifier_tensors(verifier_path)
    vocab = tensors["lm_head"].shape[0]
    if t2d.numel() != vocab:
        raise ValueError(
            f"the vocab mapping covers {t2d.numel()} target ids but the verifier's lm_head has {vocab}; "
            "was it built by `trainer.prepare` from this verifier?"
        )
    head = VerifierHead(
        norm_weight=tensors["norm"].float(),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        lm_head_weight=tensors["lm_head"],
        draft_ids=draft_to_target_ids(d2t),
        target_to_draft=target_to_draft_ids(t2d),
    )
    return head, tensors["embed_tokens"]


def load_verifier(
    path: str | Path, device: torch.device | str, dtype: torch.dtype, trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The verifier in eval mode and its tokenizer. `device="auto"` spreads its layers over every visible GPU
    (accelerate's `device_map="auto"`); anything else puts the whole model on that device."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    major_minor = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    dtype_arg = "dtype" if major_minor >= (4, 56) else "torch_dtype"
    kwargs = {dtype_arg: dtype, "trust_remote_code": trust_remote_code}
    if str(device) == "auto":
        model = AutoModelForCausalLM.from_pretrained(str(path), device_map="auto", **kwargs).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    return model, tokenizer


def decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack without the lm_head (`model.model` for Llama and most others)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.base_model


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The stack of decoder layers of a causal LM (`model.model.layers` for Llama and most others)."""
    num_layers = model.config.get_text_config().num_hidden_layers
    layers = getattr(decoder(model), "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
        return layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


@contextmanager
def capture_layers(
    layers: torch.nn.ModuleList, layer_ids: Sequence[int], last_output: bool = False
) -> Iterator[dict]:
    """During forward passes in the block, `captured[i]` is the input hidden state of layer i for each i in
    `layer_ids` (the residual stream entering it: vLLM's and SGLang's capture point), and with `last_output`,
    `captured["last"]` the output of the last layer (before the final norm)."""
    captured: dict = {}

    def save_input(index: int):
        def hook(module, args, kwargs):
            captured[index] = args[0] if args else kwargs["hidden_states"]

        return hook

    def save_output(module, args, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handles = [layers[i].register_forward_pre_hook(save_input(i), with_kwargs=True) for i in set(layer_ids)]
    if last_output:
        handles.append(layers[-1].register_forward_hook(save_output))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def concat_features(captured: dict, layer_ids: Sequence[int]) -> Tensor:
    """The captured layer inputs concatenated in `layer_ids` order [..., 3H] (on the first one's device: with
    the verifier spread over GPUs, they come from different devices)."""
    first = captured[layer_ids[0]]
    return torch.cat([captured[i].to(first.device) for i in layer_ids], dim=-1)


@torch.no_grad()
def capture_hidden_states(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    layer_ids: Sequence[int],
    top_ids: bool = False,
    chunk_rows: int = 4096,
) -> tuple[Tensor, ...]:
    """Run the verifier's decoder once: (inputs of `layer_ids` concatenated [B, S, 3H], last layer output [B, S, H]),
    and with `top_ids` the verifier's top-1 token id at every position [B, S] (its lm_head over the decoder's
    normed output, in chunks of rows, so that no [B, S, vocab] tensor exists at once).

    The last layer output is taken before the final norm; HF's `hidden_states[-1]` is after it in
    transformers 5, so it is read with a hook rather than from `output_hidden_states`.
    """
    with capture_layers(decoder_layers(model), layer_ids, last_output=True) as captured:
        output = decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    features = concat_features(captured, layer_ids), captured["last"]
    if not top_ids:
        return features
    head = model.get_output_embeddings()
    normed = output[0]
    flat = normed.reshape(-1, normed.shape[-1]).to(head.weight.device)
    top = torch.cat([head(flat[i : i + chunk_rows]).argmax(-1) for i in range(0, flat.shape[0], chunk_rows)])
    return *features, top.view(normed.shape[:-1])


def layer_devices(model: PreTrainedModel) -> list[str]:
    """The device of each decoder layer, in order (several GPUs when the verifier is spread over them)."""
    return [str(next(layer.parameters()).device) for layer in decoder_layers(model)]
