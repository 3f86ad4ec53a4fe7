"""Long-context test-time-training layers: transformer blocks whose fast weights learn while reading.

inner = InnerLoopConfig(params=["layers.*.ttt_mlp.*"], lr=1.0)
model = TTTTransformer(Transformer(cfg), TTTConfig(suffix_len=1), inner)
model.token_losses(tokens).mean().backward()   # differentiates through the inner steps

Any transformers causal LM instead (its own parameters adapt; slower than the converted model):
TransformersTTTReader(load_causal_lm(TransformersModelConfig(checkpoint=DIR)), ttt, inner).

Both read with the engine of `ttt.reading` (SuffixBlock and TTTConfig are re-exported from there).
"""

from ttt.reading import SuffixBlock, TTTConfig

from .model import TTTTransformer
from .transformers_reader import TransformersTTTReader

__all__ = ["SuffixBlock", "TTTConfig", "TTTTransformer", "TransformersTTTReader"]
