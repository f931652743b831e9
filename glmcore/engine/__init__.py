"""The engine: request state (request.py), the slot table and KV policy (slots.py), schedule / update
(step.py), the step loop (scheduler.py), speculative drafters (speculative.py) and the prompt cache that
outlives the slots (prompt_cache.py)."""
from .request import OVERFLOW_POLICIES, Handle, Request, RequestState, Slot, Status, Timings, WindowPolicy
from .scheduler import QueueFull, Scheduler
from .prompt_cache import common_prefix
from .slots import Room, SlotTable, make_room
from .speculative import Method, NgramDrafter, Speculation

__all__ = ["OVERFLOW_POLICIES", "Handle", "Method", "NgramDrafter", "QueueFull", "Request", "RequestState", "Room",
           "Scheduler", "Slot", "SlotTable", "Speculation", "Status", "Timings", "WindowPolicy", "common_prefix",
           "make_room"]
