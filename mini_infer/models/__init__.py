"""Model intake: loading checkpoints, GGUF files and presets (see loader.py, presets.py)."""

from mini_infer.models.loader import DEFAULT_MODEL, LoadedModel, ModelNotFoundError, load_model
from mini_infer.models.presets import preset_config, preset_names

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelNotFoundError", "load_model", "preset_config", "preset_names"]
