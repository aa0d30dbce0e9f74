"""Exceptions a user can act on: each names the architecture, path, weight or config field at fault."""
from __future__ import annotations


class ModelLoadError(Exception):
    """Base class: the model could not be built or loaded."""


class ModelPathError(ModelLoadError):
    """The path is missing, unreadable, or not a model (config.json + safetensors, or .gguf)."""


class UnknownArchitectureError(ModelLoadError):
    """config.json names an architecture this package does not implement."""


class UnsupportedConfigError(ModelLoadError):
    """The architecture is known but a config field has a value we do not implement."""


class MissingWeightError(ModelLoadError):
    """The checkpoint lacks a weight the model needs."""


class UnexpectedWeightError(ModelLoadError):
    """The checkpoint holds a weight the model has no place for."""


class WeightShapeError(ModelLoadError):
    """A checkpoint weight has a different shape than the model expects."""
