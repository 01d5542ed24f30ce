"""Interop: sluice's Rate Limit Quota Service answers Envoy's own generated client (PyPI
xds-protos + grpcio, envoy.service.rate_limit_quota.v3).

Starts the sluice binary named by $SLUICE with one rule of 100/s and checks, through the stubs
Envoy's API generates: a stream without a domain is INVALID_ARGUMENT; a ban is DENY_ALL; three
Envoys offering 300, 100 and 20 requests/s for one bucket, each enforcing its assignment, are
assigned token buckets that add up to at most the rule, the small one its demand and the other
two the rest 3 : 1, and together admit within the stated bound and at least 80 % of the rule.

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


def report(domain, bucket, per_second):
    usage = Usage(bucket_id=rlqs_pb2.BucketId(bucket=bucket), num_requests_allowed=per_second)
    usage.time_elapsed.seconds = 1
    return Reports(domain=domain, bucket_quota_usages=[usage])


class Envoy:
    """One simulated Envoy: a stream fed from a queue; a thread reads its answers, keeping the
    latest assignment, as Envoy applies each one it receives."""

    def __init__(self, stub, first):
        self.requests = queue.Queue()
        self.requests.put(first)
        self.answers = stub.StreamRateLimitQuotas(iter(self.requests.get, None), timeout=30)
        self.received = queue.Queue()
        self.latest = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for answer in self.answers:
                action = answer.bucket_action[0].quota_assignment_action
                self.latest = action
                self.received.put(action)
        except grpc.RpcError as e:
            self.received.put(e)

    def send(self, message):
        self.requests.put(message)

    def assignment(self):
        """The next answer's assignment, or the error the stream ended with."""
        answer = self.received.get(timeout=10)
        if isinstance(answer, grpc.RpcError):
            raise answer
        return answer

    def close(self):
        self.requests.put(None)
        self.answers.cancel()


def rate(assignment):
    b = assignment.rate_limit_strategy.token_bucket
    interval = b.fill_interval.seconds + b.fill_interval.nanos / 1e9
    return b.tokens_per_fill.value / interval


class Quota(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Server(policy=POLICY)
        cls.stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(cls.s.channel)

    @classmethod
    def tearDownClass(cls):
        cls.s.close()

    def test_a_stream_without_a_domain_is_invalid_argument(self):
        envoy = Envoy(self.stub, report("", {"tenant": "a"}, 1))
        with self.assertRaises(grpc.RpcError) as refused:
            envoy.assignment()
        self.assertEqual(refused.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        envoy.close()

    def test_a_ban_is_deny_all(self):
        envoy = Envoy(self.stub, report("quota", {"banned": "x"}, 1))
        a = envoy.assignment()
        self.assertEqual(a.rate_limit_strategy.WhichOneof("strategy"), "blanket_rule")
        self.assertEqual(a.rate_limit_strategy.blanket_rule,
                         a.rate_limit_strategy.BlanketRule.DENY_ALL)
        self.assertGreater(a.assignment_time_to_live.seconds, 0)
        envoy.close()

    def test_three_envoys_enforcing_their_assignments_share_the_rule(self):
        """Three Envoys offer 300, 100 and 20 requests/s for one bucket of a 100/s rule (burst
        100), each enforcing the token bucket it was last assigned and reporting what it allowed
        and denied every 250 ms, for 6 s."""
        bucket = {"tenant": "enforced"}
        demands = [300, 100, 20]
        interval, span, step = 0.25, 6.0, 0.005
        envoys, buckets = [], []
        for demand in demands:
            sent = time.monotonic()
            envoy = Envoy(self.stub, report("quota", bucket, demand))
            envoy.assignment()
            self.assertLess(time.monotonic() - sent, 0.1, "the first assignment within 100 ms")
            envoys.append(envoy)
            buckets.append(TokenBucket())
        admitted = []  # (time, envoy) of every request let through
        counts = [[0, 0] for _ in envoys]  # allowed, denied since the last report
        owed = [0.0 for _ in envoys]
        start = last_report = time.monotonic()
        now = start
        try:
            while now - start < span:
                time.sleep(step)
                previous, now = now, time.monotonic()
                for i, (envoy, tb) in enumerate(zip(envoys, buckets)):
                    tb.apply(envoy.latest, now)
                    owed[i] += demands[i] * (now - previous)
                    while owed[i] >= 1.0:
                        owed[i] -= 1.0
                        if tb.take(now):
                            counts[i][0] += 1
                            admitted.append((now - start, i))
                        else:
                            counts[i][1] += 1
                if now - last_report >= interval:
                    for envoy, c in zip(envoys, counts):
                        envoy.send(usage_report(bucket, c[0], c[1], now - last_report))
                        c[0] = c[1] = 0
                    last_report = now
            rates = [rate(e.latest) for e in envoys]
            self.assertLessEqual(sum(rates), 100.0, rates)
            self.assertGreaterEqual(rates[2], demands[2], f"the small one is met: {rates}")
            self.assertAlmostEqual(rates[0] / rates[1], 3.0, delta=0.6,
                                   msg=f"the rest split 3 : 1: {rates}")
            for envoy in envoys:
                self.assertGreater(envoy.latest.assignment_time_to_live.seconds, 0)
            # The bound, B + R x (W + TTL), over every window of 1 s and 3 s; and from the
            # second second on, at least 80 % of the rule admitted.
            ttl = envoys[0].latest.assignment_time_to_live.seconds
            times = [t for t, _ in admitted]
            for width in (1.0, 3.0):
                worst = max(sum(1 for t in times if w <= t < w + width)
                            for w in [x * 0.1 for x in range(int((span - width) * 10) + 1)])
                self.assertLessEqual(worst, 100 + 100 * (width + ttl), (width, worst))
            settled = sum(1 for t in times if t >= 1.0) / (span - 1.0)
            print(f"\n  assigned {', '.join(f'{r:.2f}' for r in rates)}/s; admitted "
                  f"{settled:.1f}/s from the second second on", file=sys.stderr)
            self.assertGreaterEqual(settled, 80.0, f"admitted {settled:.1f}/s of 100/s")
            # The largest leaves: within two report intervals, the others' next reports are
            # answered with larger shares.
            envoys[0].close()
            before = rates[1]
            left = time.monotonic()
            while rate(envoys[1].latest) <= 1.5 * before and time.monotonic() - left < 2 * interval:
                for envoy, demand in zip(envoys[1:], demands[1:]):
                    envoy.send(report("", bucket, demand))
                time.sleep(interval / 5)
            self.assertGreater(rate(envoys[1].latest), 1.5 * before,
                               "the share of a stream that left moves within two intervals")
        finally:
            for envoy in envoys:
                envoy.close()


class TokenBucket:
    """What Envoy enforces for one bucket: the strategy last assigned, a new token bucket
    (full) when the strategy changes, the same one when it is renewed unchanged."""

    def __init__(self):
        self.strategy = None
        self.tokens = 0.0
        self.at = 0.0

    def apply(self, assignment, now):
        if assignment is None:
            return
        strategy = assignment.rate_limit_strategy.SerializeToString()
        if strategy != self.strategy:
            self.strategy = strategy
            self.bucket = assignment.rate_limit_strategy.token_bucket
            self.tokens = float(self.bucket.max_tokens)
            self.at = now

    def take(self, now):
        b = self.bucket
        interval = b.fill_interval.seconds + b.fill_interval.nanos / 1e9
        fills = int((now - self.at) / interval)
        if fills:
            self.tokens = min(float(b.max_tokens), self.tokens + fills * b.tokens_per_fill.value)
            self.at += fills * interval
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


def usage_report(bucket, allowed, denied, elapsed):
    usage = Usage(bucket_id=rlqs_pb2.BucketId(bucket=bucket), num_requests_allowed=allowed,
                  num_requests_denied=denied)
    usage.time_elapsed.seconds = int(elapsed)
    usage.time_elapsed.nanos = int((elapsed - int(elapsed)) * 1e9)
    return Reports(bucket_quota_usages=[usage])


if __name__ == "__main__":
    unittest.main()
