"""Interop: Redis paused (`SIGSTOP`) for 30 s under 5,000 calls a second, with
`on_backend_error: local` and the breaker off (a slow Redis that never trips it, so every call
waits for its deadline or finds the queue full): the server's memory stays bounded, and once
Redis resumes its counters charge nothing for the calls answered locally.

The real binary is driven by `loadgen` (benches/load/loadgen.rs, built as an example), paced to
5,000 calls a second over 8 connections of 8 streams, first 2 s with Redis answering, then 30 s
on counters Redis has never seen while it is paused. The server's VmRSS is sampled from /proc
every second; the bound is +64 MiB over the sample taken after the first load, before the
pause (the queue in front of Redis holds 1,024 requests; past it a call is answered at once).
After the resume each paused-on counter is read with a check of cost 0: what it was charged is
at most the calls in flight when Redis stopped answering, four calls of 128 requests.

Skipped with a notice without redis-server or the loadgen example, except on CI (env CI set),
where both are required.

Run: cargo build --example loadgen && SLUICE=target/debug/sluice \
     python3 -m unittest tests/interop/test_redis_pause.py -v
"""

import os
import re
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Redis, Sluice, have_redis  # noqa: E402

# One token per 10 minutes per user, with a burst of 2,000: a paused-on counter refills at most
# one token before it is read, so a charge still shows; and its numbers fit the coalesced
# (lean) script, whose queue is what a pause fills.
BURST = 2_000
POLICY = f"""
domain: bench
descriptors:
  - key: user
    rate_limit: {{name: per-user, unit: minute, unit_multiplier: 10, requests_per_unit: 1,
                 burst: {BURST}}}
"""

RATE = 5_000
PAUSE_S = 30
# Counters of the load during the pause: values Redis has never seen.
KEYS, OFFSET = 100, 1_000_000
RSS_BOUND_MIB = 64
# The calls in flight on the connection when Redis stopped answering, which it may still carry
# out on resuming (src/limiter/redis/coalesce.rs: IN_FLIGHT calls of MAX_REQUESTS requests).
IN_FLIGHT_REQUESTS = 4 * 128

LOADGEN = os.environ.get("LOADGEN", "target/debug/examples/loadgen")


def have_loadgen():
    if os.path.exists(LOADGEN):
        return True
    if os.environ.get("CI"):
        raise RuntimeError(f"{LOADGEN} is required on CI (cargo build --example loadgen)")
    print(f"test_redis_pause: skipped: {LOADGEN} is not built (cargo build --example loadgen)")
    return False


HAVE_ALL = have_redis("test_redis_pause") and have_loadgen()

D = ratelimit_pb2.RateLimitDescriptor


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        kb = int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1))
    return kb / 1024


def loadgen(grpc, seconds, offset):
    """`loadgen` paced to RATE calls a second on KEYS `user` counters from `offset`, running."""
    return subprocess.Popen(
        [LOADGEN, "--addr", grpc, "-c", "8", "-m", "8", "--rate", str(RATE),
         "--warm-up", "0.5", "--seconds", str(seconds - 0.5), "--keys", str(KEYS),
         "--key-offset", str(offset), "--descriptors", "1", "--domain", "bench"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc):
    """The `key=value` figures of a finished loadgen run."""
    out, err = proc.communicate(timeout=30)
    figures = dict(kv.split("=", 1) for kv in out.split())
    if "rate" not in figures:
        raise RuntimeError(f"loadgen printed no figures: {out!r} {err!r}")
    return figures


@unittest.skipUnless(HAVE_ALL, "redis-server or loadgen is missing")
class RedisPausedUnderLoad(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        with open(os.path.join(self.dir.name, "bench.yaml"), "w") as f:
            f.write(POLICY)
        self.redis = Redis()
        self.addCleanup(self.redis.close)
        self.s = Sluice({
            "PATH": os.environ.get("PATH", ""),
            "SLUICE_GRPC_ADDR": "127.0.0.1:0", "SLUICE_ADMIN_ADDR": "127.0.0.1:0",
            "SLUICE_LOG_FORMAT": "json", "SLUICE_POLICIES": self.dir.name,
            "SLUICE_BACKEND": "redis", "SLUICE_REDIS__URL": f"redis://127.0.0.1:{self.redis.port}",
            "SLUICE_ON_BACKEND_ERROR": "local", "SLUICE_REDIS__FLEET_SIZE": "1",
            "SLUICE_REDIS__BREAKER_FAILURES": "0",
        })
        self.addCleanup(self.s.close)
        # A paused Redis is resumed whatever happens, so that it can be stopped.
        self.addCleanup(self.redis.proc.send_signal, 18)  # SIGCONT

    def metric(self, name):
        with urllib.request.urlopen(f"http://{self.s.admin}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def remaining(self, key):
        """What counter `user=u<key>` holds, read with a check of cost 0 (it charges nothing)."""
        d = D(entries=[D.Entry(key="user", value=f"u{key}")])
        d.hits_addend.value = 0
        answer = self.s.call(rls_pb2.RateLimitRequest(domain="bench", descriptors=[d]))
        return answer.statuses[0].limit_remaining

    def test_memory_stays_bounded_and_local_answers_charge_nothing(self):
        pid = self.s.proc.pid
        self.s.warm(rls_pb2.RateLimitRequest(
            domain="bench", descriptors=[D(entries=[D.Entry(key="user", value="warm")])]))
        before_load = finished(loadgen(self.s.grpc, 2, 0))
        before = rss_mib(pid)

        os.kill(self.redis.proc.pid, 19)  # SIGSTOP
        load = loadgen(self.s.grpc, PAUSE_S, OFFSET)
        samples = []
        start = time.monotonic()
        while load.poll() is None:
            samples.append(rss_mib(pid))
            time.sleep(max(0.0, start + len(samples) - time.monotonic()))
        paused = finished(load)
        samples.append(rss_mib(pid))
        os.kill(self.redis.proc.pid, 18)  # SIGCONT

        peak = max(samples)
        calls = int(paused["calls"])
        print(f"\ntest_redis_pause: {before_load['rate']} calls/s before the pause, then "
              f"{paused['rate']} calls/s ({calls} calls, {paused['ok']} OK, "
              f"{paused['over_limit']} over, {paused['grpc_errors']} gRPC errors) over the "
              f"{PAUSE_S} s pause; VmRSS {before:.1f} MiB before it, peak {peak:.1f} MiB, "
              f"last {samples[-1]:.1f} MiB", flush=True)
        self.assertEqual(int(paused["transport_errors"]), 0, paused)
        # Every call answered, locally, with a decision: none failed for want of Redis.
        self.assertEqual(int(paused["ok"]), calls, paused)
        # The pause was under load, not a trickle (the generator's own rate is reported above).
        self.assertGreater(calls, PAUSE_S * RATE // 5, paused)
        self.assertLess(peak - before, RSS_BOUND_MIB,
                        f"VmRSS grew from {before:.1f} to {peak:.1f} MiB: {samples}")

        # Back on Redis: every read below answered by it, and the paused-on counters charged at
        # most the calls in flight when Redis stopped answering (late answers are given back,
        # so the charge may still fall while this waits).
        charged, by_redis = None, 'sluice_backend_decisions_total{by="redis"}'
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            answered = self.metric(by_redis)
            left = [self.remaining(OFFSET + k) for k in range(KEYS)]
            if self.metric(by_redis) - answered == KEYS:
                charged = sum(BURST - r for r in left)
                if charged <= IN_FLIGHT_REQUESTS:
                    break
            time.sleep(0.2)
        self.assertIsNotNone(charged, "Redis never answered again")
        print(f"test_redis_pause: the paused-on counters charged {charged} of the {calls} calls "
              "answered locally", flush=True)
        self.assertLessEqual(charged, IN_FLIGHT_REQUESTS,
                             f"{charged} charged in Redis for {calls} calls answered locally")


if __name__ == "__main__":
    unittest.main()
