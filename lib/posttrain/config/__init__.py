"""Typed, frozen configuration built from YAML; unknown keys fail at load naming the key."""

from posttrain.config.loader import build, load_yaml, to_dict

__all__ = ["build", "load_yaml", "to_dict"]
