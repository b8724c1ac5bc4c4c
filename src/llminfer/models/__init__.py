"""Model helpers: the built-in tiny default model and random-weight test models."""

from llminfer.models.builtin import (
    BUILTIN_MODEL_NAME,
    build_random_model,
    builtin_model_path,
    default_cache_dir,
    extract_builtin_tokenizer,
)

__all__ = [
    "BUILTIN_MODEL_NAME",
    "build_random_model",
    "builtin_model_path",
    "default_cache_dir",
    "extract_builtin_tokenizer",
]
