"""One HTTP client per process for posttrain's own requests to servers it waits on or polls (the temporary
Prefect server, `vllm serve`, Atropos' run-api). A top-level `httpx.get` builds a new client, and with it an SSL
context, on every call: ~70 ms of CPU, which a loop polling /health every 0.1 s pays each time (measured: ~7 s of
CPU while a temporary Prefect server starts)."""

from __future__ import annotations

import threading

_client = None
_lock = threading.Lock()


def client():
    """The process's shared `httpx.Client` (made on first use; thread-safe; per-request timeouts)."""
    global _client
    if _client is None:
        with _lock:
            if _client is None:
                import httpx

                _client = httpx.Client()
    return _client
