"""The engine core: the loop (:mod:`~llminfer.core.engine_core`), the scheduler and its queues."""

from llminfer.core.engine_core import EngineCore
from llminfer.core.scheduler import Scheduler, SchedulerLimits

__all__ = ["EngineCore", "Scheduler", "SchedulerLimits"]
