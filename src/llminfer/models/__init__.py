"""Models: where they come from (the built-in random tiny one, the trained SmolLM2 GGUF, GGUF files,
random-weight test models) and how one is loaded (``loading``), quantized (``weight_only``, ``quant``), put on
llminfer's CPU kernels (``kernel_swap``) and given its CPU dtype (``dtype_probe``). Only the first group is
imported here; the loading modules are imported where they are used."""

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
