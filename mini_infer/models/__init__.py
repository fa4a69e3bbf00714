"""Model intake: what a model argument names and what is known before loading (model_info.py), loading
checkpoints, GGUF files and presets (loader.py, presets.py)."""

from mini_infer.models.loader import LoadedModel, load_model
from mini_infer.models.model_info import DEFAULT_MODEL, ModelLoadError, ModelNotFoundError, inspect_model
from mini_infer.models.presets import preset_config, preset_names

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelLoadError", "ModelNotFoundError", "inspect_model", "load_model",
           "preset_config", "preset_names"]
