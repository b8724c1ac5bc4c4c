"""The pipeline's building blocks. Assemble them with :class:`llminfer.pipeline.Pipeline`."""

from llminfer.stages.detokenize import DetokenizeStage, IncrementalDetokenizer, StopStringMatcher
from llminfer.stages.prefix_hash import PrefixHashStage
from llminfer.stages.schedule import SchedulerStage, StepStage
from llminfer.stages.sink import StreamSink
from llminfer.stages.tokenize import TokenizeStage

__all__ = [
    "DetokenizeStage",
    "IncrementalDetokenizer",
    "PrefixHashStage",
    "SchedulerStage",
    "StepStage",
    "StopStringMatcher",
    "StreamSink",
    "TokenizeStage",
]
