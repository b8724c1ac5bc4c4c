"""Regenerate ``src/llminfer/assets/qwen2_tokenizer.tar.xz`` from a llama.cpp vocab file.

Usage::

    python tools/make_tokenizer_asset.py path/to/ggml-vocab-qwen2.gguf [-o OUTPUT]

Needs the ``gguf`` package (``pip install 'llminfer[tokenizer-tools]'``) because
transformers reads GGUF files through it, and the llama.cpp vocab-only file
``ggml-vocab-qwen2.gguf`` (from llama.cpp's ``models/`` folder). Only this tool
reads that file; the installed package uses the archive it writes.

What it does:

1. loads the tokenizer with ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``
   and ``save_pretrained``s it into a temporary folder;
2. drops the ``[PAD151646]``..``[PAD151935]`` placeholders llama.cpp uses to pad
   the vocab to the embedding size (they are not real Qwen2 tokens);
3. writes a ``tokenizer_config.json`` in the Qwen2-Instruct style: ``eos_token`` is
   ``<|im_end|>`` (ends a chat turn), ``pad_token`` is ``<|endoftext|>``, no BOS,
   ``<|im_start|>``/``<|im_end|>`` as additional special tokens;
4. packs ``tokenizer.json`` (minified), ``tokenizer_config.json`` and
   ``chat_template.jinja`` into a reproducible tar archive with xz preset 9e;
5. loads the archive back and, when llama.cpp's test vectors ``<gguf>.inp`` /
   ``<gguf>.out`` sit next to the gguf file, reports how many encodings match.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import re
import sys
import tarfile
import tempfile
from pathlib import Path

DEFAULT_OUTPUT = (
    Path(__file__).resolve().parents[1] / "src" / "llminfer" / "assets" / "qwen2_tokenizer.tar.xz"
)
PLACEHOLDER = re.compile(r"^\[PAD\d+\]$")
TEST_SEPARATOR = "\n__ggml_vocab_test__\n"
TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    "model_max_length": 32768,
    "clean_up_tokenization_spaces": False,
    "split_special_tokens": False,
}


def build_files(gguf_path: Path) -> dict[str, bytes]:
    """Return the archive members (file name -> content) made from ``gguf_path``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        spec = json.loads(Path(tmp, "tokenizer.json").read_text(encoding="utf-8"))
        template_file = Path(tmp, "chat_template.jinja")
        template = (
            template_file.read_text(encoding="utf-8") if template_file.exists() else tokenizer.chat_template
        )
    if not template or "<|im_start|>" not in template:
        raise SystemExit(f"{gguf_path}: no ChatML chat template found")

    spec["added_tokens"] = [t for t in spec["added_tokens"] if not PLACEHOLDER.match(t["content"])]
    spec["model"]["vocab"] = {
        tok: i for tok, i in spec["model"]["vocab"].items() if not PLACEHOLDER.match(tok)
    }
    for token in spec["added_tokens"]:
        if token["content"] in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            token["special"] = True

    return {
        "tokenizer.json": json.dumps(spec, ensure_ascii=False, separators=(",", ":")).encode(),
        "tokenizer_config.json": (json.dumps(TOKENIZER_CONFIG, indent=2) + "\n").encode(),
        "chat_template.jinja": template.encode(),
    }


def write_archive(files: dict[str, bytes], output: Path) -> None:
    """Write ``files`` as a reproducible (fixed mtime/owner, sorted) ``.tar.xz``."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))


def check_archive(archive: Path, gguf_path: Path) -> None:
    """Load the archive back, check special tokens/template and llama.cpp test vectors."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        tok = AutoTokenizer.from_pretrained(tmp)
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_token == "<|im_end|>" and {"<|im_end|>", "<|endoftext|>"} <= set(tok.all_special_tokens)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), prompt
    print(f"loaded back: {len(tok)} tokens, eos {tok.eos_token}={im_end}, <|endoftext|>={eot}")

    inp, out = Path(f"{gguf_path}.inp"), Path(f"{gguf_path}.out")
    if not (inp.exists() and out.exists()):
        print("no llama.cpp test vectors next to the gguf file; skipped")
        return
    texts = inp.read_text(encoding="utf-8").split(TEST_SEPARATOR)[:-1]
    expected = [[int(i) for i in line.split()] for line in out.read_text(encoding="utf-8").splitlines()]
    bad = [
        t for t, ids in zip(texts, expected, strict=True) if tok.encode(t, add_special_tokens=False) != ids
    ]
    print(f"llama.cpp test vectors: {len(texts) - len(bad)}/{len(texts)} match")
    for text in bad:
        print(f"  mismatch: {text!r}")
    if bad:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path, help="llama.cpp vocab file, e.g. ggml-vocab-qwen2.gguf")
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="archive to write")
    args = parser.parse_args(argv)
    write_archive(build_files(args.gguf), args.output)
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB)")
    check_archive(args.output, args.gguf)


if __name__ == "__main__":
    sys.exit(main())
