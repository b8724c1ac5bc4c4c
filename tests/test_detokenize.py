"""The incremental detokenizer: its Rust path (``tokenizers``' DecodeStream) against the Python one and against
``tokenizer.decode`` of the whole sequence, on the built-in model's real Qwen2 tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llminfer.models import builtin_model_path
from llminfer.stages.detokenize import IncrementalDetokenizer, rust_decoder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(builtin_model_path()))


class PythonOnly:
    """A tokenizer that is not a transformers ``TokenizersBackend``: the detokenizer keeps its Python path."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)


def _pieces(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add(chunk) for chunk in chunks] + [detok.flush()]


def _chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


@st.composite
def token_ids(draw, tokenizer):
    """Ids that stress the detokenizer: pieces of multi-byte characters split across tokens, special tokens,
    spaces, and arbitrary ids of the vocabulary."""
    text_ids = tokenizer.encode("日本語 🎉 naïve  café\n\n x", add_special_tokens=False)
    pool = st.one_of(
        st.sampled_from(text_ids),
        st.sampled_from(sorted(tokenizer.all_special_ids)),
        st.integers(0, len(tokenizer) - 1),
        st.sampled_from(tokenizer.encode("🎉", add_special_tokens=False)[:1]),  # a character's first bytes only
    )
    return draw(st.lists(pool, min_size=0, max_size=24))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans(), cuts=st.lists(st.integers(0, 30), max_size=8))
def test_streamed_text_joins_to_decode_and_matches_the_python_path(tokenizer, data, skip, cuts):
    ids = data.draw(token_ids(tokenizer))
    chunks = _chunked(ids, cuts)
    rust = IncrementalDetokenizer(tokenizer, skip)
    python = IncrementalDetokenizer(PythonOnly(tokenizer), skip)
    assert rust._stream is not None and python._stream is None
    rust_pieces, python_pieces = _pieces(rust, chunks), _pieces(python, chunks)
    assert "".join(rust_pieces) == "".join(python_pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    # No released piece before the flush ends inside a character.
    assert not any(piece.endswith("\ufffd") for piece in rust_pieces[:-1])
    # A token at a time, both paths release the same text at the same token (nothing is held longer).
    singles = [[token_id] for token_id in ids]
    assert (_pieces(IncrementalDetokenizer(tokenizer, skip), singles)
            == _pieces(IncrementalDetokenizer(PythonOnly(tokenizer), skip), singles))


def test_rust_path_only_where_decode_is_the_rust_tokenizers(tokenizer):
    import copy

    assert rust_decoder(tokenizer) is tokenizer._tokenizer
    assert rust_decoder(PythonOnly(tokenizer)) is None
    cleaned = copy.copy(tokenizer)
    cleaned.clean_up_tokenization_spaces = True  # transformers edits the text after decode: keep its path
    assert rust_decoder(cleaned) is None


def test_a_refused_stream_step_goes_on_in_python(tokenizer):
    """If DecodeStream refuses a step, the request goes on in Python with nothing lost or repeated."""
    ids = tokenizer.encode("Hello there, 日本語 world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)

    class Refusing:
        def step(self, *_):
            raise RuntimeError("invalid prefix")

    first = detok.add(ids[:3])
    detok._stream = Refusing()
    rest = detok.add(ids[3:5]) + detok.add(ids[5:]) + detok.flush()
    assert detok._stream is None
    assert first + rest == tokenizer.decode(ids)
