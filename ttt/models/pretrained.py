"""Load a Hugging Face-format checkpoint (a local directory with config.json and safetensors) onto
the project's models, with attention through the project's switch (FlashBoB by default).

    model = from_pretrained("/data/SmolLM2-135M", attention="flashbob", window=1024)
    logits = model(tokens)                     # tokens (B, N) int64 -> logits (B, N, vocab), float32

Supported `architectures` (config.json):
    LlamaForCausalLM (Llama 2/3 without rope scaling, SmolLM / SmolLM2, TinyLlama) -> `Transformer`
    Qwen2ForCausalLM (Qwen2, Qwen2.5; q/k/v biases)                                   -> `Transformer`
    GPT2LMHeadModel (GPT-2, DistilGPT2)                                                -> `GPT2`
Weights: model.safetensors, or shards listed in model.safetensors.index.json. Every tensor is
checked: a missing, unexpected or mis-shaped weight is an error that names it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .gpt2 import GPT2, GPT2Config
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

GPT2_NAMES = [
    (r"wte\.weight", "embed.weight"),
    (r"wpe\.weight", "pos_embed.weight"),
    (r"h\.(\d+)\.ln_1\.(weight|bias)", r"layers.\1.attn_norm.\2"),
    (r"h\.(\d+)\.attn\.c_attn\.(weight|bias)", r"layers.\1.attn.c_attn.\2"),
    (r"h\.(\d+)\.attn\.c_proj\.(weight|bias)", r"layers.\1.attn.wo.\2"),
    (r"h\.(\d+)\.ln_2\.(weight|bias)", r"layers.\1.mlp_norm.\2"),
    (r"h\.(\d+)\.mlp\.c_fc\.(weight|bias)", r"layers.\1.mlp.w_in.\2"),
    (r"h\.(\d+)\.mlp\.c_proj\.(weight|bias)", r"layers.\1.mlp.w_out.\2"),
    (r"ln_f\.(weight|bias)", r"norm.\1"),
]
"""Hugging Face GPT-2 tensor names (without the optional "transformer." prefix) -> `GPT2` names;
c_attn is split into wq, wk, wv afterwards."""

GPT2_IGNORED = r"h\.\d+\.attn\.(bias|masked_bias)|lm_head\.weight"
"""Causal-mask buffers of older GPT-2 checkpoints, and the head (tied to wte)."""


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"config.json: rope scaling {rope_type!r} is not supported (only plain RoPE, rope_type 'default')"
        )
    return float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))


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
    return TransformerConfig(
        vocab_size=_required(hf, "vocab_size"),
        d_model=_required(hf, "hidden_size"),
        n_layers=_required(hf, "num_hidden_layers"),
        n_heads=_required(hf, "num_attention_heads"),
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        d_ff=_required(hf, "intermediate_size"),
        rope_theta=_rope_theta(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=hf["architectures"][0] == "Qwen2ForCausalLM",
    )


def gpt2_config(hf: dict) -> GPT2Config:
    """`GPT2Config` of a GPT-2 config.json (parsed)."""
    _require_false(hf, "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")
    for key in ("scale_attn_weights", "tie_word_embeddings"):
        if hf.get(key) is False:
            raise ValueError(
                f"config.json: {key}=false is not supported (GPT-2 scales attention and ties its head)"
            )
    return GPT2Config(
        vocab_size=_required(hf, "vocab_size"),
        d_model=_required(hf, "n_embd"),
        n_layers=_required(hf, "n_layer"),
        n_heads=_required(hf, "n_head"),
        d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
        max_positions=_required(hf, "n_positions"),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=hf.get("activation_function", "gelu_new"),
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


def gpt2_state_dict(tensors: dict[str, torch.Tensor], cfg: GPT2Config) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 tensors -> `GPT2` state dict. GPT-2's Conv1D weights are stored (in, out):
    they are transposed, and the fused c_attn (d, 3d) is split into wq, wk, wv."""
    state = _rename(
        {name.removeprefix("transformer."): t for name, t in tensors.items()}, GPT2_NAMES, GPT2_IGNORED
    )
    out = {}
    for name, tensor in state.items():
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            kind = name.rsplit(".", 1)[1]
            if tensor.shape[-1] != 3 * cfg.d_model:
                raise ValueError(
                    f"tensor {name}: expected last dimension 3 * d_model = {3 * cfg.d_model}, "
                    f"got shape {tuple(tensor.shape)}"
                )
            for head, part in zip("qkv", tensor.split(cfg.d_model, dim=-1)):
                out[name.replace("c_attn", f"w{head}")] = part.t() if kind == "weight" else part
        elif tensor.dim() == 2 and (".attn." in name or ".mlp." in name):
            out[name] = tensor.t()
        else:
            out[name] = tensor
    return out


ARCHITECTURES: dict[str, tuple[Callable, type[nn.Module], Callable]] = {
    "LlamaForCausalLM": (llama_config, Transformer, llama_state_dict),
    "Qwen2ForCausalLM": (llama_config, Transformer, llama_state_dict),
    "GPT2LMHeadModel": (gpt2_config, GPT2, gpt2_state_dict),
}
"""config.json `architectures[0]` -> (config parser, model class, weight mapper)."""


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


def pretrained_config(path: str | Path, **overrides) -> TransformerConfig | GPT2Config:
    """The model config of checkpoint directory `path`, with `overrides` (config field -> value) applied."""
    hf = read_hf_config(Path(path))
    parse_config = ARCHITECTURES[hf["architectures"][0]][0]
    return _with_overrides(parse_config(hf), overrides)


def from_pretrained(
    path: str | Path, *, dtype: torch.dtype = torch.float32, **overrides
) -> Transformer | GPT2:
    """The model stored in Hugging Face format in directory `path`, its weights cast to `dtype`.

    overrides: fields of the model config, e.g. attention="eager" or window=1024 (the attention
    backend defaults to flashbob). Calling the model on token ids (B, N) int64 returns logits
    (B, N, vocab_size).
    """
    path = Path(path)
    cfg = pretrained_config(path, **overrides)
    _, model_class, map_weights = ARCHITECTURES[read_hf_config(path)["architectures"][0]]
    model = model_class(cfg)
    load_checked(model, map_weights(read_safetensors(path), cfg))
    return model.to(dtype)
