"""Hugging Face-format checkpoints written on the fly (no download)."""

import json

import torch
from safetensors.torch import save_file

from ttt.models import Transformer

LLAMA_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def hf_llama_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Our Transformer's weights under Hugging Face Llama names (written by hand, independently of the
    loader's table)."""
    out = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight}
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.attn_norm.weight
        out[p + "post_attention_layernorm.weight"] = layer.mlp_norm.weight
        for hf, ours in (
            ("q", layer.attn.wq),
            ("k", layer.attn.wk),
            ("v", layer.attn.wv),
            ("o", layer.attn.wo),
        ):
            out[p + f"self_attn.{hf}_proj.weight"] = ours.weight
        for hf, ours in (("gate", layer.mlp.w_gate), ("up", layer.mlp.w_up), ("down", layer.mlp.w_down)):
            out[p + f"mlp.{hf}_proj.weight"] = ours.weight
    return {name: t.detach().clone().contiguous() for name, t in out.items()}


def write_checkpoint(path, config: dict, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path
