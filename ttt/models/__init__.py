"""Models built on one attention switch (`ttt.models.attention.attention`)."""

from .attention import ATTENTION_BACKENDS, attention
from .mlp import MLP, MLPConfig
from .pretrained import from_pretrained
from .rope import RopeScaling
from .transformer import Transformer, TransformerConfig, next_token_loss, next_token_losses

__all__ = [
    "ATTENTION_BACKENDS",
    "MLP",
    "MLPConfig",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "attention",
    "from_pretrained",
    "next_token_loss",
    "next_token_losses",
]
