"""What several interop tests need: a free port, and a wait for a server's health check."""

import socket
import time
import urllib.request


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(admin, timeout=30):
    """Waits until `http://{admin}/healthcheck` answers 200, at most `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{admin}/healthcheck", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError("sluice did not become healthy")
        time.sleep(0.1)
