"""What several interop tests need: a free port, a wait for a server's health check, a
redis-server of their own, and `sluice serve` with a given environment."""

import json
import os
import queue
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc


def have_redis(module):
    """Whether redis-server is installed. Without it `module`'s Redis tests skip with a printed
    notice, except on CI (env CI set), where it is required."""
    if shutil.which("redis-server") is not None:
        return True
    if os.environ.get("CI"):
        raise RuntimeError("redis-server is required on CI (Debian: apt-get install redis-server)")
    print(f"{module}: Redis tests skipped: redis-server is not installed "
          "(Debian: apt-get install redis-server)")
    return False


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


def redis_command(port, *args):
    """One command in RESP over a fresh connection; the raw reply."""
    out = f"*{len(args)}\r\n".encode()
    for a in args:
        out += f"${len(a.encode())}\r\n{a}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(out)
        time.sleep(0.05)
        return s.recv(1 << 16)


class Redis:
    def __init__(self):
        self.dir = tempfile.TemporaryDirectory()
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 15
        while True:
            try:
                if redis_command(self.port, "PING").startswith(b"+PONG"):
                    return
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.1)

    def keys(self, pattern):
        return redis_command(self.port, "KEYS", pattern)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=15)
        self.dir.cleanup()


class Sluice:
    """`sluice serve` with exactly `env` as its environment, once it serves and, with `redis`,
    has connected to Redis (before that a call would get `on_backend_error`); its addresses from
    its JSON log."""

    def __init__(self, env, redis=True):
        self.proc = subprocess.Popen(
            [os.environ.get("SLUICE", "target/debug/sluice"), "serve"],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log = []
        lines = queue.Queue()

        def drain():
            # Read the whole log, so the server never blocks on a full pipe.
            for line in self.proc.stderr:
                self.log.append(line)
                lines.put(line)
        self.drain = threading.Thread(target=drain, daemon=True)
        self.drain.start()
        deadline = time.time() + 30
        wanted = {"serving", "connected to redis"} if redis else {"serving"}
        seen = set()
        while seen != wanted:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                raise RuntimeError(f"sluice did not start and connect: {self.log}") from None
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("message") in wanted:
                seen.add(event["message"])
            if event.get("message") == "serving":
                self.grpc, self.admin = event["grpc"], event["admin"]
        self.channel = grpc.insecure_channel(self.grpc)
        self.stub = rls_pb2_grpc.RateLimitServiceStub(self.channel)

    def call(self, req):
        return self.stub.ShouldRateLimit(req, timeout=5)

    def warm(self, req):
        """Calls `req` until Redis answers it: the first call also loads the script, which on a
        busy machine can take longer than the Redis deadline (`on_backend_error` answers it)."""
        deadline = time.time() + 15
        while True:
            try:
                return self.call(req)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.time() > deadline:
                    raise
                time.sleep(0.1)

    def get(self, path):
        with urllib.request.urlopen(f"http://{self.admin}{path}", timeout=5) as r:
            return r.read().decode()

    def close(self):
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(timeout=15)
        self.drain.join(timeout=5)
        self.proc.stderr.close()
