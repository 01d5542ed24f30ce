"""Interop: sluice's Rate Limit Quota Service answers Envoy's own generated client (PyPI
xds-protos + grpcio, envoy.service.rate_limit_quota.v3).

Starts the sluice binary named by $SLUICE with one rule of 100/s and checks, through the stubs
Envoy's API generates and a simulated Envoy built from its RLQS client: a stream without a
domain is INVALID_ARGUMENT; a ban is DENY_ALL; a new bucket's first report (time_elapsed 0) is
assigned within 100 ms; three Envoys offering 300, 100 and 20 requests/s for one bucket, each
enforcing its assignment and reporting every 250 ms (time_elapsed 0 each time), hold token
buckets that, read as Envoy reads them, never add up past the rule, the small one its demand
and each of the other two, which ask for the rule or more, at least its fair part, and together
admit within the stated bound and at least 80 % of the rule.

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_quota.py -v
"""

import os
import queue
import sys
import threading
import time
import unittest

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_envoy_client import Server  # noqa: E402

POLICY = """
domain: quota
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: banned
    rate_limit: {unit: second, requests_per_unit: 0}
"""

Reports = rlqs_pb2.RateLimitQuotaUsageReports
Usage = Reports.BucketQuotaUsage
ALLOW_ALL, DENY_ALL = 0, 1  # envoy.type.v3.RateLimitStrategy.BlanketRule


def envoy_rate(token_bucket):
    """The rate Envoy enforces: tokens_per_fill over the interval's whole seconds
    (absl::ToInt64Seconds); under a second it divides by zero, no limit."""
    seconds = int(token_bucket.fill_interval.seconds + token_bucket.fill_interval.nanos / 1e9)
    return float("inf") if seconds <= 0 else token_bucket.tokens_per_fill.value / seconds


def same_for_envoy(a, b):
    """Envoy's protoTokenBucketsEq: the interval's seconds are not compared."""
    return (a.max_tokens == b.max_tokens and a.tokens_per_fill.value == b.tokens_per_fill.value
            and a.fill_interval.nanos == b.fill_interval.nanos)


class Limiter:
    """Envoy's AtomicTokenBucketImpl: continuous fill at a rate up to a capacity; starts full."""

    def __init__(self, spec, now):
        self.spec, self.rate = spec, envoy_rate(spec)
        self.tokens, self.at = float(spec.max_tokens), now

    def take(self, now):
        self.tokens = min(float(self.spec.max_tokens), self.tokens + self.rate * (now - self.at))
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class Bucket:
    def __init__(self, now):
        self.allowed, self.denied = 1, 0  # the request that created it (no assignment: allowed)
        self.last_report = self.created = now
        self.cached = None  # the token bucket of the last action, as Envoy caches it
        self.limiter = None
        self.blanket = None
        self.first_assigned = None


class Envoy:
    """One simulated Envoy, built from its RLQS client (global_client_impl.cc): a new bucket is
    reported at once with its first request and time_elapsed 0; report_all() is the
    reporting_interval timer, reporting every bucket with time_elapsed in whole seconds,
    truncated; a token bucket is enforced at tokens_per_fill over the interval's whole seconds,
    starting full, and replaces the one in force only when max_tokens, tokens_per_fill or the
    interval's nanos differ. A thread reads the answers and applies them."""

    def __init__(self, stub, domain, first):
        self.domain = domain
        self.lock = threading.Lock()
        self.buckets = {}
        self.history = []  # (time, bucket key, rate) of every token bucket put in force
        self.ignored = []  # token buckets Envoy kept the old one for, though their rate differs
        self.requests = queue.Queue()
        self.errors = queue.Queue()
        self.answered = threading.Event()
        key = self._create(first, time.monotonic())
        self.answers = stub.StreamRateLimitQuotas(iter(self.requests.get, None), timeout=30)
        threading.Thread(target=self._read, daemon=True).start()
        self.first = key

    def _create(self, bucket, now):
        key = tuple(sorted(bucket.items()))
        with self.lock:
            self.buckets[key] = Bucket(now)
            message = Reports(domain=self.domain,
                              bucket_quota_usages=[self._usage(key, self.buckets[key], now)])
        self.requests.put(message)
        return key

    @staticmethod
    def _usage(key, b, now):
        usage = Usage(bucket_id=rlqs_pb2.BucketId(bucket=dict(key)),
                      num_requests_allowed=b.allowed, num_requests_denied=b.denied)
        usage.time_elapsed.seconds = int(now - b.last_report)
        b.allowed = b.denied = 0
        b.last_report = now
        return usage

    def _read(self):
        try:
            for answer in self.answers:
                self._apply(answer, time.monotonic())
        except grpc.RpcError as e:
            self.errors.put(e)
            self.answered.set()

    def _apply(self, answer, now):
        with self.lock:
            for action in answer.bucket_action:
                key = tuple(sorted(action.bucket_id.bucket.items()))
                b = self.buckets.get(key)
                if b is None:
                    continue
                if action.HasField("abandon_action"):
                    del self.buckets[key]
                    continue
                strategy = action.quota_assignment_action.rate_limit_strategy
                if b.first_assigned is None:
                    b.first_assigned = now - b.created
                if strategy.WhichOneof("strategy") == "blanket_rule":
                    b.blanket, b.limiter, b.cached = strategy.blanket_rule, None, None
                    continue
                tb = strategy.token_bucket
                if b.limiter is not None and b.cached is not None and same_for_envoy(tb, b.cached):
                    if envoy_rate(tb) != b.limiter.rate or tb.max_tokens != b.limiter.spec.max_tokens:
                        self.ignored.append((b.limiter.spec, tb))
                else:
                    b.limiter, b.blanket = Limiter(tb, now), None
                    self.history.append((now, key, b.limiter.rate))
                b.cached = tb
        self.answered.set()

    def request(self, bucket, now):
        key = tuple(sorted(bucket.items()))
        with self.lock:
            b = self.buckets.get(key)
            if b is not None:
                if b.limiter is not None:
                    allowed = b.limiter.take(now)
                elif b.blanket is not None:
                    allowed = b.blanket == ALLOW_ALL
                else:
                    allowed = True
                if allowed:
                    b.allowed += 1
                else:
                    b.denied += 1
                return allowed
        self._create(bucket, now)
        return True

    def report_all(self, now):
        with self.lock:
            usages = [self._usage(k, b, now) for k, b in self.buckets.items()]
        if usages:
            self.requests.put(Reports(domain=self.domain, bucket_quota_usages=usages))

    def first_assignment(self, bucket, timeout=10):
        """How long after its creation the bucket was first assigned; raises the error the
        stream ended with."""
        key = tuple(sorted(bucket.items()))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.errors.empty():
                raise self.errors.get()
            with self.lock:
                b = self.buckets.get(key)
                if b is not None and b.first_assigned is not None:
                    return b.first_assigned
            self.answered.wait(0.005)
            self.answered.clear()
        raise AssertionError("no assignment in time")

    def rate(self, bucket):
        with self.lock:
            b = self.buckets.get(tuple(sorted(bucket.items())))
            return None if b is None or b.limiter is None else b.limiter.rate

    def blanket(self, bucket):
        with self.lock:
            b = self.buckets.get(tuple(sorted(bucket.items())))
            return None if b is None else b.blanket

    def close(self):
        self.requests.put(None)
        self.answers.cancel()


# How late one Envoy may take a smaller token bucket sent before another's larger one: they
# travel on different connections.
IN_TRANSIT = 0.05


def most_in_force(envoys, key):
    """The most the token buckets the Envoys put in force for a bucket ever added up to, read as
    Envoy reads them (each credited with a smaller bucket up to IN_TRANSIT before it came)."""
    histories = [[(t, r) for t, k, r in e.history if k == key] for e in envoys]

    def held(h, t):
        rates = [r for w, r in h if w <= t][-1:] or [0.0]
        rates += [r for w, r in h if t < w <= t + IN_TRANSIT]
        return min(rates)

    times = [t for h in histories for t, _ in h]
    return max((sum(held(h, t) for h in histories) for t in times), default=0.0)


class Quota(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Server(policy=POLICY)
        cls.stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(cls.s.channel)

    @classmethod
    def tearDownClass(cls):
        cls.s.close()

    def test_a_stream_without_a_domain_is_invalid_argument(self):
        envoy = Envoy(self.stub, "", {"tenant": "a"})
        with self.assertRaises(grpc.RpcError) as refused:
            envoy.first_assignment({"tenant": "a"})
        self.assertEqual(refused.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        envoy.close()

    def test_a_ban_is_deny_all(self):
        envoy = Envoy(self.stub, "quota", {"banned": "x"})
        self.assertLess(envoy.first_assignment({"banned": "x"}), 0.1)
        self.assertEqual(envoy.blanket({"banned": "x"}), DENY_ALL)
        self.assertFalse(envoy.request({"banned": "x"}, time.monotonic()))
        envoy.close()

    def test_three_envoys_enforcing_their_assignments_share_the_rule(self):
        """Three Envoys offer 300, 100 and 20 requests/s for one bucket of a 100/s rule (burst
        100), each enforcing the token bucket in force and reporting every 250 ms, for 6 s: a
        first report says time_elapsed 0, and so does every later one, under a second apart."""
        bucket = {"tenant": "enforced"}
        key = tuple(sorted(bucket.items()))
        demands = [300, 100, 20]
        interval, span, step = 0.25, 6.0, 0.005
        envoys = []
        for demand in demands:
            envoy = Envoy(self.stub, "quota", bucket)
            first = envoy.first_assignment(bucket)
            self.assertLess(first, 0.1, "the first assignment within 100 ms")
            envoys.append(envoy)
        admitted = []  # (time, envoy) of every request let through
        owed = [0.0 for _ in envoys]
        start = last_report = time.monotonic()
        now = start
        try:
            while now - start < span:
                time.sleep(step)
                previous, now = now, time.monotonic()
                for i, envoy in enumerate(envoys):
                    owed[i] += demands[i] * (now - previous)
                    while owed[i] >= 1.0:
                        owed[i] -= 1.0
                        if envoy.request(bucket, now):
                            admitted.append((now - start, i))
                if now - last_report >= interval:
                    for envoy in envoys:
                        envoy.report_all(now)
                    last_report = now
            for envoy in envoys:
                self.assertTrue(envoy.errors.empty(), "the streams go on")
                self.assertEqual(envoy.ignored, [], "every change is put in force")
            rates = [e.rate(bucket) for e in envoys]
            most = most_in_force(envoys, key)
            print(f"\n  assigned {', '.join(f'{r:.2f}' for r in rates)}/s as Envoy reads them; "
                  f"at most {most:.2f}/s in force at once", file=sys.stderr)
            self.assertLessEqual(most, 100.0 + 1e-9, "the buckets in force, read as Envoy reads them")
            self.assertLessEqual(sum(rates), 100.0, rates)
            self.assertGreaterEqual(rates[2], demands[2], f"the small one is met: {rates}")
            for rate in rates[:2]:
                self.assertGreaterEqual(rate, 100.0 / 3 * 0.99, f"a fair part each: {rates}")
            # The bound, B + R x (W + TTL), over every window of 1 s and 3 s; and from the
            # second second on, at least 80 % of the rule admitted.
            ttl = 10
            times = [t for t, _ in admitted]
            for width in (1.0, 3.0):
                worst = max(sum(1 for t in times if w <= t < w + width)
                            for w in [x * 0.1 for x in range(int((span - width) * 10) + 1)])
                self.assertLessEqual(worst, 100 + 100 * (width + ttl), (width, worst))
            settled = sum(1 for t in times if t >= 1.0) / (span - 1.0)
            print(f"  admitted {settled:.1f}/s from the second second on", file=sys.stderr)
            self.assertGreaterEqual(settled, 80.0, f"admitted {settled:.1f}/s of 100/s")
            # The largest leaves: within two report intervals, the others' next reports are
            # answered with larger shares.
            envoys[0].close()
            before = rates[1]
            left = time.monotonic()
            while envoys[1].rate(bucket) <= 1.5 * before and time.monotonic() - left < 2 * interval:
                now = time.monotonic()
                for envoy, demand in zip(envoys[1:], demands[1:]):
                    for _ in range(int(demand * interval / 5)):
                        envoy.request(bucket, now)
                    envoy.report_all(now)
                time.sleep(interval / 5)
            self.assertGreater(envoys[1].rate(bucket), 1.5 * before,
                               "the share of a stream that left moves within two intervals")
        finally:
            for envoy in envoys:
                envoy.close()


if __name__ == "__main__":
    unittest.main()
