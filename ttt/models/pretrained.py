"""Load a Hugging Face-format checkpoint (a local directory with config.json and safetensors) onto
the project's models, with attention through the project's switch (FlashBoB by default).

    model = from_pretrained("/data/SmolLM2-135M", attention="flashbob", window=1024)
    logits = model(tokens)                     # tokens (B, N) int64 -> logits (B, N, vocab), float32

Supported `architectures` (config.json):
    LlamaForCausalLM (Llama 2/3/3.1/3.2, SmolLM / SmolLM2, TinyLlama)                -> `Transformer`
    Qwen2ForCausalLM (Qwen2, Qwen2.5; q/k/v biases)                                   -> `Transformer`
RoPE: plain, or scaled as Llama 3.1's "llama3" or YaRN's "yarn" (`ttt.models.rope`).
Weights: model.safetensors, or shards listed in model.safetensors.index.json. Every tensor is
checked: a missing, unexpected or mis-shaped weight is an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .rope import RopeScaling
from .transformer import Transformer, TransformerConfig

LLAMA_NAMES = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", r"layers.\1.attn.w\2.\3"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attn.wo.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.mlp_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.w_\2.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]
"""Hugging Face Llama / Qwen2 tensor names -> `Transformer` parameter names."""

LLAMA_IGNORED = r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"
"""Buffers some older Llama checkpoints store; they are recomputed."""

ROPE_SCALING_KEYS = {
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"), ("beta_fast", "beta_slow", "attention_factor")),
}
"""rope_type -> (required keys, optional keys) of a config.json rope scaling that `RopeScaling` takes."""

YARN_ONLY_VALUES = {"mscale": None, "mscale_all_dim": None, "truncate": True, "partial_rotary_factor": 1.0}
"""YaRN options -> the one value taken (absent counts as it): DeepSeek's mscale pair, an untruncated
blend and partial rotary dimensions are not implemented."""


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) of a config.json: rope_scaling / rope_parameters of rope_type
    "default" (plain RoPE), "llama3" or "yarn"; any other type or option is refused by name."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_SCALING_KEYS:
        supported = ", ".join(repr(name) for name in ("default", *ROPE_SCALING_KEYS))
        raise ValueError(f"config.json: rope scaling {rope_type!r} is not supported (rope_type {supported})")
    required, optional = ROPE_SCALING_KEYS[rope_type]
    missing = [key for key in required if scaling.get(key) is None]
    if missing:
        raise ValueError(f"config.json: rope scaling {rope_type!r} is missing {missing}")
    if rope_type == "yarn":
        for key, taken in YARN_ONLY_VALUES.items():
            value = scaling.get(key)
            if value is not None and value != taken:
                raise ValueError(
                    f"config.json: rope scaling 'yarn' with {key}={value!r} is not supported "
                    f"(expected {taken!r} or absent)"
                )
    given = {}
    for key in (*required, *optional):
        if scaling.get(key) is None:
            continue
        kind = int if key == "original_max_position_embeddings" else float
        try:
            given[key] = kind(scaling[key])
        except (TypeError, ValueError):
            raise ValueError(
                f"config.json: rope scaling {rope_type!r}: {key}={scaling[key]!r} is not a number"
            ) from None
    return theta, RopeScaling(rope_type=rope_type, **given)


def _required(hf: dict, key: str):
    if key not in hf:
        raise ValueError(f"config.json of a {hf['architectures'][0]}: missing key {key!r}")
    return hf[key]


def _require_false(hf: dict, *keys: str) -> None:
    for key in keys:
        if hf.get(key):
            raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (expected false or absent)")


def llama_config(hf: dict) -> TransformerConfig:
    """`TransformerConfig` of a Llama or Qwen2 config.json (parsed)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act must be 'silu' (SwiGLU), got {hf['hidden_act']!r}")
    _require_false(hf, "attention_bias", "mlp_bias", "use_sliding_window")
    rope_theta, rope_scaling = _rope(hf)
    return TransformerConfig(
        vocab_size=_required(hf, "vocab_size"),
        d_model=_required(hf, "hidden_size"),
        n_layers=_required(hf, "num_hidden_layers"),
        n_heads=_required(hf, "num_attention_heads"),
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        d_ff=_required(hf, "intermediate_size"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=hf["architectures"][0] == "Qwen2ForCausalLM",
    )


def _rename(tensors: dict[str, torch.Tensor], table: list, ignored: str) -> dict[str, torch.Tensor]:
    renamed, unknown = {}, []
    for name, tensor in tensors.items():
        if re.fullmatch(ignored, name):
            continue
        for pattern, target in table:
            if re.fullmatch(pattern, name):
                renamed[re.sub(pattern, target, name)] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"checkpoint has tensors this architecture does not know: {unknown[:10]}")
    return renamed


def llama_state_dict(tensors: dict[str, torch.Tensor], cfg: TransformerConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama / Qwen2 tensors -> `Transformer` state dict (drops a stored lm_head when tied)."""
    state = _rename(tensors, LLAMA_NAMES, LLAMA_IGNORED)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""config.json `architectures[0]` values that load onto `Transformer` (GPT-2 and any other Hugging Face
model run with our attention through transformers itself, `flashbob.register_transformers`)."""


def read_hf_config(path: Path) -> dict:
    """The parsed config.json of checkpoint directory `path`, checked to name a supported architecture."""
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.checkpoint={str(path)!r}: expected a checkpoint directory, found none"
        )
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model.checkpoint={str(path)!r}: no config.json in the checkpoint directory")
    hf = json.loads(config_file.read_text())
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise ValueError(
            f"{config_file}: unsupported architectures {architectures}; supported: {sorted(ARCHITECTURES)}"
        )
    return hf


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint directory `path`: model.safetensors, or the shards that
    model.safetensors.index.json lists."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(load_file(path / shard))
        return tensors
    raise FileNotFoundError(
        f"model.checkpoint={str(path)!r}: no model.safetensors or model.safetensors.index.json"
    )


def load_checked(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model`; every parameter must be given, with its exact shape, and nothing else."""
    expected = dict(model.named_parameters())
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint weights do not fit the model: missing {missing[:10]}, unexpected {unexpected[:10]}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, "
                f"model expects {tuple(expected[name].shape)}"
            )
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(state[name])


def _with_overrides(cfg, overrides: dict):
    fields = [f.name for f in dataclasses.fields(cfg)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown model overrides {unknown}; valid keys of {type(cfg).__name__}: {fields}")
    return dataclasses.replace(cfg, **overrides)


def pretrained_config(path: str | Path, **overrides) -> TransformerConfig:
    """The model config of checkpoint directory `path`, with `overrides` (config field -> value) applied."""
    return _with_overrides(llama_config(read_hf_config(Path(path))), overrides)


def from_pretrained(path: str | Path, *, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """The model stored in Hugging Face format in directory `path`, its weights cast to `dtype`.

    overrides: fields of the model config, e.g. attention="eager" or window=1024 (the attention
    backend defaults to flashbob). Calling the model on token ids (B, N) int64 returns logits
    (B, N, vocab_size).
    """
    path = Path(path)
    cfg = pretrained_config(path, **overrides)
    model = Transformer(cfg)
    load_checked(model, llama_state_dict(read_safetensors(path), cfg))
    return model.to(dtype)
