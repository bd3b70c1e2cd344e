"""A real uvicorn server on a free 127.0.0.1 port, in a thread of the test process, for tests
that drive it with the official `openai` client."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

# The tests' polls of local servers share one client: httpx.get builds a client, and with it a
# TLS context that loads the CA bundle, ~24 ms of CPU each call, so a poll every 50 ms kept half
# a core busy (40 s of one test's CPU while the ranks it waited on restarted)
LOCAL = httpx.Client(timeout=30)


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app`; yield its base URL; stop it at the end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def metric_samples(url: str) -> dict[str, float]:
    """Every sample of /metrics as 'name{label=value,...}' -> value, parsed by prometheus_client."""
    text = LOCAL.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def wait_until(condition, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
