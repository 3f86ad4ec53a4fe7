"""Fixtures of the pretrained-model tests."""

import pytest
import torch
from hf_checkpoints import LLAMA_JSON, hf_llama_tensors, write_checkpoint

from ttt.models import Transformer, TransformerConfig


@pytest.fixture
def llama_reference(tmp_path):
    """A random tiny Transformer and its checkpoint directory in Hugging Face Llama format."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        rope_theta=500.0,
        attention="eager",
    )
    model = Transformer(cfg)
    return model, write_checkpoint(tmp_path / "llama", LLAMA_JSON, hf_llama_tensors(model))
