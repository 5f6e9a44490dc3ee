"""Pure-Python scheduling: ready queues, batch building, KV page accounting,
and the plan of each step (`StepPlan`)."""

from mstar.scheduler.pages import PagePool
from mstar.scheduler.plan import LaunchSteps, StandingGroup, StepPlan
from mstar.scheduler.scheduler import Scheduler
from mstar.scheduler.work import Batch, ModeCaps, WorkItem

__all__ = ["Batch", "LaunchSteps", "ModeCaps", "PagePool", "Scheduler", "StandingGroup", "StepPlan", "WorkItem"]
