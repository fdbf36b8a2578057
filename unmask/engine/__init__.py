"""The engine: requests, a scheduler, per-decoder batches and `step()`.

- request.py   Request (one prompt's decode) and StepEvent (what a step did for it)
- scheduler.py which requests run (row and slot budgets), plain Python
- batch.py     the decode state of one decoder's rows, with extend/filter
- decoder.py   one step of one decoder: draft -> forward -> verify -> accept -> finish
- runner.py    one model call over a set of canvas rows
- engine.py    Engine.add_request / step / abort; `decode` for a whole batch
"""

from unmask.engine.engine import Engine, decode
from unmask.engine.request import Request, StepEvent
from unmask.engine.scheduler import QueueFull, SchedulerConfig

__all__ = ["Engine", "decode", "Request", "StepEvent", "QueueFull", "SchedulerConfig"]
