"""What a serving benchmark sends, where, and at what load: the workload (:class:`ServingWorkload`: random
prompts or a JSONL file), the target (:class:`ServingConfig`) and the load points of a sweep
(:class:`LoadPoint`: a Poisson request rate and a cap on requests in flight), with the parsers of the
``bench-serve`` flags that name them. No network and no polars here: the CLI checks these flags at once.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "number group problem fact model token cache block batch queue server stream layer kernel page").split()


@attrs.define
class ServingWorkload:
    """What to send: random prompts (``prompt_len`` words, ``output_len`` tokens, uniform ranges) or a JSONL
    file of ``{"prompt": ..., "max_tokens": ...}`` lines."""

    num_requests: int = 100
    prompt_len: tuple[int, int] = (16, 128)
    output_len: tuple[int, int] = (16, 128)
    prompts_file: str | None = None
    seed: int = 0

    def requests(self) -> list[tuple[str, int]]:
        """``(prompt, max_tokens)`` pairs.

        Raises:
            ValueError: an empty or malformed prompts file.
        """
        rng = random.Random(self.seed)
        if self.prompts_file:
            rows = []
            for n, line in enumerate(Path(self.prompts_file).read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    rows.append((str(obj["prompt"]), int(obj.get("max_tokens", rng.randint(*self.output_len)))))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{self.prompts_file}:{n}: expected {{\"prompt\": ..., \"max_tokens\": ...}} "
                                     f"({exc})") from None
            if not rows:
                raise ValueError(f"{self.prompts_file} holds no prompts")
            return [rows[i % len(rows)] for i in range(self.num_requests)]
        return [(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(*self.prompt_len))),
                 rng.randint(*self.output_len)) for _ in range(self.num_requests)]


@attrs.define
class ServingConfig:
    """Where and how to send the load.

    Attributes:
        base_url: the server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` is appended).
        model: the model name to send (None: the first of ``GET /v1/models``).
        request_rate: mean arrivals per second (Poisson); ``inf`` sends everything at once.
        concurrency: most requests in flight (None: unlimited).
        endpoint: ``"completions"`` or ``"chat"``.
        extra_body: extra JSON fields for every request (e.g. ``{"ignore_eos": true}`` for vLLM).
        slo_ttft_ms, slo_tpot_ms: service-level objectives for goodput.
        timeout_s: per-request timeout (s).
        label: this server's name in the artifact (``bench-report``'s default label).
        warmup_requests: requests sent one by one before the first load point and left out of every
            figure (they open a connection and wake the server, as vLLM's benchmark does with its test prompt).
    """

    base_url: str
    model: str | None = None
    request_rate: float = math.inf
    concurrency: int | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    extra_body: dict[str, Any] = attrs.field(factory=dict)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 200.0
    timeout_s: float = 600.0
    label: str | None = None
    warmup_requests: int = 0


@attrs.frozen
class LoadPoint:
    """One load setting of a sweep: Poisson arrivals at ``request_rate`` requests/s (``inf``: all at once),
    at most ``concurrency`` requests in flight (None: no cap)."""

    request_rate: float = math.inf
    concurrency: int | None = None

    def label(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        return f"rate {rate}, concurrency {'-' if self.concurrency is None else self.concurrency}"

    def to_json(self) -> dict[str, Any]:
        return {"request_rate": None if math.isinf(self.request_rate) else self.request_rate,
                "concurrency": self.concurrency}


def load_points(request_rates: Sequence[float] = (math.inf,),
                concurrencies: Sequence[int | None] = (None,)) -> list[LoadPoint]:
    """The sweep: one point per request rate, or one per concurrency (the other value fixed).

    Raises:
        ValueError: both lists have several values (a report plots one load axis), a rate <= 0 or a
            concurrency < 1.
    """
    rates, concs = list(request_rates) or [math.inf], list(concurrencies) or [None]
    if len(rates) > 1 and len(concs) > 1:
        raise ValueError("sweep request rates or concurrencies, not both (give one of them a single value)")
    if any(not r > 0 for r in rates):  # NaN too
        raise ValueError(f"request rates must be > 0 (inf: all at once), got {rates}")
    if any(c is not None and c < 1 for c in concs):
        raise ValueError(f"concurrencies must be >= 1, got {concs}")
    return [LoadPoint(r, c) for r in rates for c in concs]


def parse_request_rates(text: str) -> list[float]:
    """``"1,2,4,inf"`` → ``[1.0, 2.0, 4.0, inf]`` (requests/s).

    Raises:
        ValueError: a value that is not a number or not > 0.
    """
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"request rates are comma-separated numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"request rates must be > 0 (inf: all at once), got {text!r}")
    return rates


def parse_concurrencies(text: str | None) -> list[int | None]:
    """``"1,8,32"`` → ``[1, 8, 32]``; None or ``""`` → ``[None]`` (no cap).

    Raises:
        ValueError: a value that is not an integer >= 1.
    """
    if text is None or not text.strip():
        return [None]
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"concurrencies are comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"concurrencies must be >= 1 (omit the flag for no limit), got {text!r}")
    return list(values)
