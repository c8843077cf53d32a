"""Iteration-level scheduler (jitted array code) and its plain-Python reference.

Public API: SchedulerLimits (the static limits ``schedule`` decides with), SchedulerState,
ScheduledBatch, init_state, add_requests, abort, recycle, schedule, update; priorities in
``priority``; the spec in ``reference``.
"""

from pagedjax.scheduler.config import SchedulerLimits
from pagedjax.scheduler.schedule import ScheduledBatch, SwapPlan, schedule
from pagedjax.scheduler.state import (
    FINISHED,
    FREE,
    REASON_ABORTED,
    REASON_CAPACITY,
    REASON_LENGTH,
    REASON_NONE,
    REASON_STOP,
    REASON_TOO_LONG,
    RUNNING,
    SWAPPED,
    WAITING,
    SchedulerState,
    abort,
    add_requests,
    init_state,
    output_target,
    recycle,
)
from pagedjax.scheduler.update import update

__all__ = [
    "FINISHED",
    "FREE",
    "REASON_ABORTED",
    "REASON_CAPACITY",
    "REASON_LENGTH",
    "REASON_NONE",
    "REASON_STOP",
    "REASON_TOO_LONG",
    "RUNNING",
    "SWAPPED",
    "WAITING",
    "ScheduledBatch",
    "SwapPlan",
    "SchedulerLimits",
    "SchedulerState",
    "abort",
    "add_requests",
    "init_state",
    "output_target",
    "recycle",
    "schedule",
    "update",
]
