"""Tiny transformers causal LMs built from transformers' own configs (random weights, no download).
Importing it skips the importing test module without transformers, and registers attn_implementation
"bob" (auto backend: torch on the CPU) and "bob_triton" (the Triton kernels; the interpreter on the CPU)."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")

import flashbob  # noqa: E402

flashbob.register_transformers("bob")
flashbob.register_transformers("bob_triton", backend="triton")

VOCAB = 97
COMMON = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
)


def tiny_config(arch: str, **overrides):
    """A transformers config of architecture `arch` (llama, qwen2, mistral, gemma2, gemma3, gpt2).

    The sliding-window architectures get a window of 5 keys so that a 23-token input exercises it.
    """
    import transformers as tf

    if arch == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, **COMMON)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(
            vocab_size=VOCAB, use_sliding_window=True, sliding_window=5, max_window_layers=1, **COMMON
        )
    elif arch == "mistral":
        cfg = tf.MistralConfig(vocab_size=VOCAB, sliding_window=5, **COMMON)
    elif arch == "gemma2":
        cfg = tf.Gemma2Config(
            vocab_size=VOCAB, head_dim=8, sliding_window=5, attn_logit_softcapping=None, **COMMON
        )
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(vocab_size=VOCAB, head_dim=8, sliding_window=5, **COMMON)
    elif arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    else:
        raise ValueError(f"unknown arch {arch!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


ARCHS = ("llama", "qwen2", "mistral", "gemma2", "gemma3", "gpt2")
SLIDING_ARCHS = ("qwen2", "mistral", "gemma2", "gemma3")


def tiny_model(arch: str, attn: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A tiny model of `arch` with attn_implementation=attn; the same seed gives the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), attn_implementation=attn)
    return model.to(dtype).eval()


def cached_forward(model, ids: torch.Tensor, cache=None, **kwargs):
    """model(ids (B, n), use_cache=True, **kwargs), `cache` passed under the name this transformers takes
    (`cache` since 5.25, `past_key_values` before, removed in 5.40): (logits (B, n, vocab), its cache)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if cache is not None:
        kwargs[name] = cache
    out = model(ids, use_cache=True, **kwargs)
    return out.logits, out[name]
