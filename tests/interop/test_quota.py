"""Interop: sluice's Rate Limit Quota Service answers Envoy's own generated client (PyPI
xds-protos + grpcio, envoy.service.rate_limit_quota.v3).

Starts the sluice binary named by $SLUICE with one rule of 100/s and checks, through the stubs
Envoy's API generates: a stream without a domain is INVALID_ARGUMENT; a ban is DENY_ALL; three
streams reporting 300, 100 and 20 requests/s for one bucket are assigned token buckets that add
up to at most the rule, in proportion to their demand, each with a TTL.

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

    def test_three_envoys_share_the_rule_by_demand(self):
        bucket = {"tenant": "shared"}
        demands = [300, 100, 20]
        envoys = []
        for demand in demands:
            envoy = Envoy(self.stub, report("quota", bucket, demand))
            envoy.assignment()
            envoys.append(envoy)
        # Each reports again; shares moved by the others' arrival are pushed within a tick.
        for envoy, demand in zip(envoys, demands):
            envoy.send(report("", bucket, demand))
        deadline = time.time() + 10
        while True:
            rates = [rate(e.latest) for e in envoys]
            settled = sum(rates) <= 100.0 and abs(rates[0] / rates[1] - 3.0) < 0.3
            if settled or time.time() > deadline:
                break
            time.sleep(0.1)
        try:
            self.assertLessEqual(sum(rates), 100.0, rates)
            self.assertAlmostEqual(rates[0] / rates[1], 3.0, delta=0.3, msg=rates)
            self.assertGreater(rates[2], 0.0, rates)
            for envoy in envoys:
                self.assertGreater(envoy.latest.assignment_time_to_live.seconds, 0)
        finally:
            for envoy in envoys:
                envoy.close()


if __name__ == "__main__":
    unittest.main()
