"""Awaiting work that cannot be cancelled halfway (a prefill on a thread, a call to another
deployment) for a caller that may leave: what it makes after the caller left is undone."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger("serve")


async def finish_or_undo(work: Awaitable[T], undo: Callable[[T], object]) -> T:
    """`await work`; if the awaiting task is cancelled meanwhile, the work runs on and its
    result goes to `undo` (e.g. releasing a KVHandle nobody will decode)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: _undo(t, undo))
        raise


def _undo(task: asyncio.Future, undo: Callable) -> None:
    if task.cancelled() or task.exception() is not None:
        return  # nothing was made
    try:
        result = undo(task.result())
        if asyncio.iscoroutine(result):
            asyncio.ensure_future(result)
    except Exception:  # noqa: BLE001  a callback: nobody to raise to
        log.exception("undoing the work of a cancelled request failed")
