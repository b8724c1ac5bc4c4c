"""Model helpers: the built-in models (the random tiny one and the trained SmolLM2 GGUF), GGUF files, and
random-weight test models."""

from llminfer.models.builtin import (
    BUILTIN_MODEL_NAME,
    build_random_model,
    builtin_model_path,
    default_cache_dir,
    extract_builtin_tokenizer,
)
from llminfer.models.trained import TRAINED_MODEL_NAME, default_model, trained_gguf_path

__all__ = [
    "TRAINED_MODEL_NAME",
    "default_model",
    "trained_gguf_path",
    "BUILTIN_MODEL_NAME",
    "build_random_model",
    "builtin_model_path",
    "default_cache_dir",
    "extract_builtin_tokenizer",
]
