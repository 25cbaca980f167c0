"""The threads of the content layer's own (freeing, early writeback, running hashes)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def started(target: Callable[..., object], name: str, *args: Any) -> threading.Thread | None:
    """A daemon thread running ``target(*args)``, started; None when the process has no
    thread to spare (the caller does the work another way)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:
        return None
    return thread
