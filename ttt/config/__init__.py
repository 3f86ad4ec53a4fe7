"""Typed configs shared by every recipe, and loading a recipe's YAML with command-line overrides."""

from .choice import Choice
from .loading import ConfigError, available_recipes, load_config, to_dict, to_yaml
from .schema import OuterOptimConfig, RecipeConfig, RunConfig, TrainerConfig

__all__ = [
    "Choice",
    "ConfigError",
    "OuterOptimConfig",
    "RecipeConfig",
    "RunConfig",
    "TrainerConfig",
    "available_recipes",
    "load_config",
    "to_dict",
    "to_yaml",
]
