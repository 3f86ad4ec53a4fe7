"""Ready-made `MetaLearner` subclasses: the inner and outer losses of common problem families."""

from .context import ContextChunksConfig, ContextLearner
from .regression import RegressionLearner

__all__ = ["ContextChunksConfig", "ContextLearner", "RegressionLearner"]
