"""Pure-Python scheduling: ready queues, batch building, KV page accounting."""

from mstar.scheduler.pages import PagePool
from mstar.scheduler.scheduler import Scheduler
from mstar.scheduler.work import Batch, ModeCaps, WorkItem

__all__ = ["Batch", "ModeCaps", "PagePool", "Scheduler", "WorkItem"]
