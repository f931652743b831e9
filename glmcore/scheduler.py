"""The generation loop's public names; the loop itself lives in glmcore.engine."""
from .engine import (OVERFLOW_POLICIES, Handle, QueueFull, Request, Room, Scheduler, Slot, Speculation, Timings,
                     WindowPolicy, common_prefix, make_room)

__all__ = ["OVERFLOW_POLICIES", "Handle", "QueueFull", "Request", "Room", "Scheduler", "Slot", "Speculation",
           "Timings", "WindowPolicy", "common_prefix", "make_room"]
