"""Results returned by the Python API."""

from __future__ import annotations

import attrs


@attrs.frozen
class GenerationStats:
    """Per-request measurements (wall clock, ``time.perf_counter_ns``).

    Attributes:
        total_latency_ms: submit → final token (ms).
        ttft_ms: submit → first token (ms); 0 when no token was generated.
        throughput_tokens_per_sec: completion tokens / total latency (tokens/s).
        prompt_tokens, completion_tokens: token counts.
        cache_hit: some prompt tokens came from the prefix cache.
        cached_tokens: how many prompt tokens came from the prefix cache.
        num_preemptions: times the request was preempted (recomputed).
        spec_proposed_tokens, spec_accepted_tokens: speculative decoding draft counts.
        queue_time_ms: scheduler arrival → first scheduled (ms).
        prefill_time_ms: first scheduled → prompt fully computed (ms).
    """

    total_latency_ms: float
    ttft_ms: float
    throughput_tokens_per_sec: float
    prompt_tokens: int
    completion_tokens: int
    cache_hit: bool
    cached_tokens: int
    num_preemptions: int = 0
    queue_time_ms: float = 0.0
    prefill_time_ms: float = 0.0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0

    def with_completion_tokens(self, n: int) -> GenerationStats:
        """The same record counting ``n`` completion tokens (a stop string ended the output earlier than
        the engine knew)."""
        if n == self.completion_tokens:
            return self
        tps = n / (self.total_latency_ms / 1e3) if self.total_latency_ms > 0 else 0.0
        return attrs.evolve(self, completion_tokens=n, throughput_tokens_per_sec=tps)

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (speculative decoding), None when nothing was proposed."""
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else None


@attrs.frozen
class GenerationResult:
    """The outcome of one request: text, token ids, why it stopped, and its stats."""

    request_id: str
    generated_text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: GenerationStats
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  #: prompt tokens 1..P-1 (``prompt_logprobs`` asked)

    @property
    def text(self) -> str:
        """``generated_text`` (the name vLLM's and most clients' outputs use)."""
        return self.generated_text


@attrs.frozen
class StreamChunk:
    """One streamed piece of a request.

    Every stream ends with exactly one final chunk, which carries no output: empty ``token``, no
    ``token_ids``, no ``logprobs``; just ``finish_reason`` and ``stats``. All text is on the chunks
    before it, so this loop prints exactly ``run()``'s ``generated_text``::

        for chunk in engine.stream(prompt, max_new_tokens=32):
            if not chunk.is_final:
                print(chunk.token, end="", flush=True)
            else:
                print(f"\\n[{chunk.finish_reason}] {chunk.stats.completion_tokens} tokens")

    Attributes:
        token: the text delta (never splits a UTF-8 character, never holds part of a stop string); may be
            empty (a token whose text is held back, or that has none, such as EOS).
        token_ids: the token ids generated since the previous chunk.
        is_final: the last chunk; ``finish_reason`` and ``stats`` are set on it, and only on it.
        logprobs: entries for ``token_ids`` when logprobs were requested.
        prompt_logprobs: on the first chunk of a request that asked ``prompt_logprobs``: one entry per
            prompt token after the first (the first token has no logprob: nothing precedes it).
    """

    token: str
    token_ids: tuple[int, ...]
    is_final: bool
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@attrs.frozen
class TokenLogprob:
    """Log-probability of a chosen token and of the ``top`` most likely alternatives.

    Read after the history processors (repetition / presence / frequency penalties, no-repeat n-gram,
    bad words, EOS masking) and before temperature, top-k, top-p and min-p, i.e. the distribution the
    model proposes for this request; natural log. ``logit_bias`` is added before them, so it shows here.
    Prompt tokens (``prompt_logprobs``) are read from the raw model logits.

    Attributes:
        rank: 1 + the number of tokens more likely than ``token_id`` (set for prompt tokens; None otherwise).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
