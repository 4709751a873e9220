"""Background tasks the sidecar starts and does not await: held until done."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def spawn(tasks: set[asyncio.Task[T]], coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run ``coro`` as a task kept in ``tasks`` until it is done: the event loop
    holds only weak references to tasks, and ``tasks`` is what a shutdown cancels."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
