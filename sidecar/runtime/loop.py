"""The event loop every command runs on: uvloop by default, asyncio's own with
``SIDECAR_EVENT_LOOP=asyncio``."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from sidecar.runtime.config import Settings


def run_async(settings: Settings, coro: Coroutine) -> Any:
    """Run ``coro`` to completion on the loop ``settings.event_loop`` names; return its
    result (its exception propagates)."""
    factory = None
    if settings.event_loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)
