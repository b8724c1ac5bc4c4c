"""The built-in default model: a tiny random-weight Qwen2 with the real Qwen2 tokenizer.

It lets the engine, server and benchmarks run end to end with no download: the
tokenizer ships with the package (``assets/qwen2_tokenizer.tar.xz``) and the
weights are generated from a fixed seed the first time they are needed, then
cached on disk as an ordinary Hugging Face model folder.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from importlib import resources
from pathlib import Path

BUILTIN_MODEL_NAME = "llminfer/tiny-qwen2"
BUILTIN_MODEL_DIRNAME = "tiny-qwen2-v1"  # bump the tag whenever the recipe below changes
BUILTIN_MODEL_SPEC = {
    "architecture": "qwen2",
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 192,
    "max_position_embeddings": 2048,  # the built-in model's context length, in tokens
    "seed": 0,
    "dtype": "float32",
    "tie_word_embeddings": False,
}
ARCHITECTURES = ("qwen2", "llama", "gpt2")

_TOKENIZER_ARCHIVE = "qwen2_tokenizer.tar.xz"
_REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def default_cache_dir() -> Path:
    """Return ``$LLMINFER_CACHE_DIR`` if set, else ``~/.cache/llminfer``."""
    env = os.environ.get("LLMINFER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llminfer"


def extract_builtin_tokenizer(dest: Path) -> Path:
    """Unpack the bundled Qwen2 tokenizer (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) into ``dest``, creating it if needed, and return ``dest``.

    Existing files of the same names are overwritten. Raises ``FileNotFoundError``
    if the package was installed without its assets, ``ValueError`` if the archive
    holds anything but plain top-level files.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    archive = resources.files("llminfer") / "assets" / _TOKENIZER_ARCHIVE
    with resources.as_file(archive) as path, tarfile.open(path, mode="r:xz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or Path(member.name).name != member.name or member.name.startswith("."):
                raise ValueError(f"unexpected entry {member.name!r} in {_TOKENIZER_ARCHIVE}")
            source = tar.extractfile(member)
            assert source is not None  # regular files always have content
            (dest / member.name).write_bytes(source.read())
    return dest


def build_random_model(
    dest: Path,
    *,
    architecture: str = "qwen2",
    tokenizer_dir: Path | None = None,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 192,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
) -> Path:
    """Build a random-weight causal LM and save it as a Hugging Face folder at ``dest``.

    The folder holds ``model.safetensors``, ``config.json``, ``generation_config.json``
    and the tokenizer, so ``AutoModelForCausalLM.from_pretrained(dest)`` and
    ``AutoTokenizer.from_pretrained(dest)`` load it. Weights are drawn after
    ``torch.manual_seed(seed)``, so the same arguments give the same model.

    Args:
        dest: folder to create. It is built in a temporary folder next to it and
            renamed into place, so readers never see a half-written model; if another
            process creates ``dest`` meanwhile, that one is kept and this build dropped.
        architecture: ``"qwen2"``, ``"llama"`` or ``"gpt2"``.
        tokenizer_dir: Hugging Face tokenizer folder; the built-in Qwen2 tokenizer if None.
        vocab_size: rows of the embedding matrix; defaults to ``len(tokenizer)``.
        hidden_size, num_layers, num_heads, intermediate_size: model shape
            (``n_embd``, ``n_layer``, ``n_head``, ``n_inner`` for gpt2).
        num_kv_heads: key/value heads for grouped-query attention; ignored by gpt2,
            which has none.
        max_position_embeddings: context length in tokens (``n_positions`` for gpt2);
            also written as the tokenizer's ``model_max_length``.
        seed: torch seed for the weights.
        dtype: torch dtype name for the saved weights, e.g. ``"float32"``, ``"bfloat16"``.
        tie_word_embeddings: share input and output embeddings. Off by default: with
            tied random embeddings greedy decoding tends to repeat the last token.

    Returns:
        ``dest``.

    Raises:
        ValueError: unknown ``architecture`` or ``dtype``, a ``vocab_size`` smaller than
            the tokenizer, or heads that do not divide the sizes.
        FileExistsError: ``dest`` already exists and is not empty.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    dest = Path(dest)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype must name a torch floating-point dtype, got {dtype!r}")
    if hidden_size % num_heads:
        raise ValueError(f"num_heads ({num_heads}) must divide hidden_size ({hidden_size})")
    if architecture != "gpt2" and num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} already exists and is not empty")

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or extract_builtin_tokenizer(tmp))
        vocab_size = len(tokenizer) if vocab_size is None else vocab_size
        if vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size ({vocab_size}) is smaller than the tokenizer ({len(tokenizer)})")
        eos_ids = _stop_token_ids(tokenizer)
        bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos_ids[-1]
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[-1]

        if architecture == "gpt2":
            shape = {
                "n_embd": hidden_size,
                "n_layer": num_layers,
                "n_head": num_heads,
                "n_inner": intermediate_size,
                "n_positions": max_position_embeddings,
            }
        else:
            shape = {
                "hidden_size": hidden_size,
                "num_hidden_layers": num_layers,
                "num_attention_heads": num_heads,
                "num_key_value_heads": num_kv_heads,
                "intermediate_size": intermediate_size,
                "max_position_embeddings": max_position_embeddings,
            }
        config = AutoConfig.for_model(
            architecture,
            vocab_size=vocab_size,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_id,
            eos_token_id=eos_ids[0],
            pad_token_id=pad_id,
            **shape,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        model = model.to(torch_dtype).eval()
        model.config.dtype = torch_dtype
        model.generation_config = GenerationConfig(
            bos_token_id=bos_id,
            eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
            pad_token_id=pad_id,
        )
        from llminfer.logging import quiet_transformers

        with quiet_transformers():  # no "Writing model shards" bar on a first use
            model.save_pretrained(tmp)
        tokenizer.model_max_length = max_position_embeddings
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp (and the safetensors writer) make things owner-only
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            os.rename(tmp, dest)  # atomic; fails if another process has filled dest meanwhile
        except OSError:
            if not (dest.exists() and any(dest.iterdir())):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def builtin_model_path(cache_dir: Path | None = None) -> Path:
    """Return the local folder of the built-in model (``BUILTIN_MODEL_NAME``).

    The first call builds it (about 80 MB of float32 weights, a few seconds on a CPU)
    into ``<cache_dir>/tiny-qwen2-v1``; later calls return that folder unchanged.
    Its context length is 2048 tokens. ``cache_dir`` defaults to
    ``$LLMINFER_CACHE_DIR`` or ``~/.cache/llminfer``. Safe to call from several
    processes at once. Raises ``OSError`` if the cache folder cannot be written.
    """
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / BUILTIN_MODEL_DIRNAME
    if all((path / name).is_file() for name in _REQUIRED_FILES):
        return path
    if path.exists():  # not made by us (we rename complete folders into place): rebuild it
        shutil.rmtree(path, ignore_errors=True)
    try:
        return build_random_model(path, **BUILTIN_MODEL_SPEC)
    except FileExistsError:  # another process finished it between our check and our build
        if all((path / name).is_file() for name in _REQUIRED_FILES):
            return path
        raise


def _stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's EOS id, then ``<|im_end|>`` and ``<|endoftext|>`` if it has them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab and vocab[t] not in ids]
    if not ids:
        raise ValueError("the tokenizer has no EOS token")
    return ids
