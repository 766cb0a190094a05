"""Model loading: Hugging Face directories (safetensors) and GGUF files, see `load.py`."""

from engine.loader.load import (
    LoadedModel,
    default_model_path,
    load_config,
    load_model,
    load_tokenizer,
    resolve_device,
)

__all__ = [
    "LoadedModel",
    "default_model_path",
    "load_config",
    "load_model",
    "load_tokenizer",
    "resolve_device",
]
