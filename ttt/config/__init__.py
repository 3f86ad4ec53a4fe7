"""Typed configs shared by every recipe, and loading a recipe's YAML with command-line overrides (the
recipes themselves are the app's: `recipes.load_config`)."""

from .choice import Choice
from .loading import ConfigError, RecipeBook, load_config, to_dict, to_yaml
from .schema import OuterOptimConfig, RecipeConfig, RunConfig, TrainerConfig

__all__ = [
    "Choice",
    "ConfigError",
    "OuterOptimConfig",
    "RecipeConfig",
    "RunConfig",
    "RecipeBook",
    "TrainerConfig",
    "load_config",
    "to_dict",
    "to_yaml",
]
