"""Any Hugging Face transformers causal LM as a ttt model: token ids -> logits, with transformers'
own parameter names, attention through `attn_implementation="bob"` (flashbob.flash_attention, twice
differentiable).

    model = load_causal_lm(TransformersModelConfig(checkpoint="/data/SmolLM2-135M"))
    logits = model(tokens)                       # (B, N) int64 -> (B, N, vocab)
    select_parameters(model, ["model.layers.1.mlp.*"])   # the checkpoint's own names

`HFCausalLM` adopts the transformers model's children, so its parameter names are exactly the
checkpoint's (model.layers.0.self_attn.q_proj.weight, lm_head.weight, ...; GPT-2:
transformer.h.0.mlp.c_fc.weight, ...) and `torch.func.functional_call` substitutes them by those names.
Loading reads a local directory only (config.json + safetensors; local_files_only, never a download).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass
class TransformersModelConfig:
    """A transformers causal LM from a local directory."""

    checkpoint: str | None = None
    """Local directory with config.json and safetensors of any transformers causal LM; null: not used."""
    attn_implementation: str = "bob"
    """bob: flashbob.flash_attention (registered here; exact second derivatives); eager: transformers'
    own (materialises N x N); sdpa cannot be differentiated twice."""
    dtype: str = "float32"
    """Weights' dtype once loaded: float32, bfloat16, float16 or float64."""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"transformers.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.attn_implementation == "sdpa":
            raise ValueError(
                "transformers.attn_implementation=sdpa: SDPA's fused backward has no derivative, so the "
                "second-order inner loop cannot run through it; use bob (or eager)"
            )


@dataclass(frozen=True)
class CausalLMShape:
    """What the recipes read of a model's architecture (the fields of `TransformerConfig` they use)."""

    vocab_size: int
    n_layers: int
    window: int | None
    """Sliding window when every layer has the same one; None when any layer attends to all keys."""


def causal_lm_shape(config) -> CausalLMShape:
    """CausalLMShape of a transformers config (Llama, Qwen2, Mistral, Gemma, GPT-2, ...)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(kind != "sliding_attention" for kind in layer_types):
        window = None
    return CausalLMShape(vocab_size=config.vocab_size, n_layers=config.num_hidden_layers, window=window)


class HFCausalLM(nn.Module):
    """token ids (B, N) int64 -> logits (B, N, vocab) of a transformers causal LM, whose modules
    (hence parameter names) become this module's own."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        own = [name for name, _ in hf_model.named_parameters(recurse=False)]
        if own:
            raise ValueError(f"{type(hf_model).__name__} holds parameters outside its submodules: {own}")
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self._hf = (hf_model,)  # a tuple, so that it is not a submodule and names carry no prefix
        self.cfg = causal_lm_shape(hf_model.config)

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model (sharing this module's parameters)."""
        return self._hf[0]

    def train(self, mode: bool = True) -> HFCausalLM:
        super().train(mode)
        self.hf_model.training = mode
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf_model(input_ids=tokens, use_cache=False).logits


def _prepare_attention(attn_implementation: str) -> None:
    if attn_implementation == "bob":
        from flashbob import register_transformers

        register_transformers("bob")


def build_causal_lm(config, attn_implementation: str = "bob", dtype: str = "float32") -> HFCausalLM:
    """A randomly initialised HFCausalLM of a transformers config (tests, benchmarks)."""
    from transformers import AutoModelForCausalLM

    _prepare_attention(attn_implementation)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return HFCausalLM(model.to(DTYPES[dtype]))


def load_causal_lm(cfg: TransformersModelConfig) -> HFCausalLM:
    """The causal LM in the local directory cfg.checkpoint, as an HFCausalLM."""
    path = Path(cfg.checkpoint or "")
    if cfg.checkpoint is None or not (path / "config.json").is_file():
        raise ValueError(
            f"transformers.checkpoint must be a local directory with config.json and safetensors, "
            f"got {cfg.checkpoint!r}"
        )
    from transformers import AutoModelForCausalLM

    _prepare_attention(cfg.attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        attn_implementation=cfg.attn_implementation,
        dtype=DTYPES[cfg.dtype],
        local_files_only=True,
        use_safetensors=True,
    )
    return HFCausalLM(model)
