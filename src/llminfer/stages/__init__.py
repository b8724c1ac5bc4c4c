"""The pipeline's stages around the engine core (:class:`llminfer.core.EngineCore`, itself a stage).
Assemble them with :class:`llminfer.pipeline.Pipeline`."""

from llminfer.stages.detokenize import DetokenizeStage, IncrementalDetokenizer, StopStringMatcher
from llminfer.stages.prefix_hash import PrefixHashStage
from llminfer.stages.sink import StreamSink
from llminfer.stages.tokenize import TokenizeStage

__all__ = [
    "DetokenizeStage",
    "IncrementalDetokenizer",
    "PrefixHashStage",
    "StopStringMatcher",
    "StreamSink",
    "TokenizeStage",
]
