"""Sampling parameters and the batched sampler."""

from llminfer.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
