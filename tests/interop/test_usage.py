"""Interop: token budgets charged after the response, as Envoy Gateway and AI Gateway send them,
through Envoy's own generated client (PyPI xds-protos + grpcio), in memory and in Redis.

Envoy's route `rate_limits` with `hits_addend` sends a descriptor-level `hits_addend` (the
UInt64Value wrapper): 0 on the check before the request, and, with `apply_on_stream_done`, the
cost once the response is done (Envoy ignores that answer). sluice records such a report even
past the limit, so the next check is refused until the debt is repaid at the rule's rate.

Checked, against one server per backend: Envoy Gateway's `UsageRateLimit` (21 an hour, cost 0
then 10: OK, OK, OK, OVER); 1,000 tokens a minute against 800-token answers (two calls, then the
next admission when the debt is repaid, to the second); eight requests in flight that each report
300 (all 2,400 recorded); one report of five budgets (that key refused for four minutes, another
key untouched); a plain request refused charges nothing; and the spend metrics.

The Redis server is skipped with a notice without redis-server, except on CI (env CI set).

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_usage.py -v
"""

import os
import sys
import tempfile
import time
import unittest
import urllib.request

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Redis, Sluice, have_redis  # noqa: E402

POLICY = """
domain: usage
descriptors:
  - key: user
    rate_limit: {name: usage, unit: hour, requests_per_unit: 21}
  - key: tenant
    rate_limit: {name: tokens, unit: minute, requests_per_unit: 1000}
"""

HAVE_REDIS = have_redis("test_usage")

D = ratelimit_pb2.RateLimitDescriptor
Code = rls_pb2.RateLimitResponse.Code


def report(key, value, cost):
    """A request of one descriptor with its own cost, as Envoy fills it from `hits_addend`."""
    d = D(entries=[D.Entry(key=key, value=value)])
    d.hits_addend.value = cost
    return rls_pb2.RateLimitRequest(domain="usage", descriptors=[d])


def check(key, value):
    return report(key, value, 0)


class Budgets:
    """The cases, against `self.s`, a Sluice on the policy above; `tag` keeps each server's
    counters apart."""

    @classmethod
    def serve(cls, env, redis):
        cls.dir = tempfile.TemporaryDirectory()
        with open(os.path.join(cls.dir.name, "usage.yaml"), "w") as f:
            f.write(POLICY)
        cls.s = Sluice({
            "PATH": os.environ.get("PATH", ""),
            "SLUICE_GRPC_ADDR": "127.0.0.1:0", "SLUICE_ADMIN_ADDR": "127.0.0.1:0",
            "SLUICE_LOG_FORMAT": "json", "SLUICE_POLICIES": cls.dir.name, **env,
        }, redis=redis)

    @classmethod
    def stop(cls):
        cls.s.close()
        cls.dir.cleanup()

    def call(self, req):
        return self.s.warm(req)

    def metric(self, name, value):
        """The sample of `name` for the `tenant` rule (key1), 0 when absent."""
        with urllib.request.urlopen(f"http://{self.s.admin}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{") and 'key1="tenant"' in line:
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def test_envoy_gateway_usage_rate_limit(self):
        codes = []
        for _ in range(4):
            answer = self.call(check("user", self.tag + "eg"))
            codes.append(answer.overall_code)
            if answer.overall_code == Code.OK:
                self.call(report("user", self.tag + "eg", 10))
        self.assertEqual(codes, [Code.OK, Code.OK, Code.OK, Code.OVER_LIMIT])

    def test_a_budget_of_n_against_cost_c_allows_n_over_c_plus_one(self):
        key = self.tag + "ai"
        admitted = 0
        for _ in range(6):
            if self.call(check("tenant", key)).overall_code != Code.OK:
                break
            admitted += 1
            answer = self.call(report("tenant", key, 800))
            reported_at = time.monotonic()
        self.assertEqual(admitted, 2)
        # The report that crossed the budget was answered over the limit; Envoy ignores it.
        self.assertEqual(answer.overall_code, Code.OVER_LIMIT)
        self.assertEqual(answer.statuses[0].limit_remaining, 0)
        # 1,600 recorded against 1,000 at 60 ms a token: 36 s until a check passes.
        refused = self.call(check("tenant", key))
        self.assertEqual(refused.overall_code, Code.OVER_LIMIT)
        self.assertIn(refused.statuses[0].duration_until_reset.seconds, (36, 37))
        self.assertEqual(refused.statuses[0].limit_remaining, 0)
        time.sleep(max(0.0, reported_at + 35 - time.monotonic()))
        self.assertEqual(self.call(check("tenant", key)).overall_code, Code.OVER_LIMIT,
                         "a second before the debt is repaid")
        time.sleep(max(0.0, reported_at + 37 - time.monotonic()))
        self.assertEqual(self.call(check("tenant", key)).overall_code, Code.OK,
                         "a second after the debt is repaid")

    def test_requests_in_flight_each_report_their_spend(self):
        key = self.tag + "flight"
        before = self.metric("sluice_spend_recorded_total", "tenant")
        for _ in range(8):
            self.assertEqual(self.call(check("tenant", key)).overall_code, Code.OK)
        answers = [self.call(report("tenant", key, 300)) for _ in range(8)]
        self.assertEqual([a.overall_code for a in answers],
                         [Code.OK] * 3 + [Code.OVER_LIMIT] * 5)
        self.assertEqual(self.metric("sluice_spend_recorded_total", "tenant") - before, 2400)
        # 2,400 recorded: 144 s of debt against a bucket of 60 s.
        refused = self.call(check("tenant", key))
        self.assertEqual(refused.overall_code, Code.OVER_LIMIT)
        self.assertIn(refused.statuses[0].duration_until_reset.seconds, (83, 84))

    def test_one_report_of_five_budgets_and_other_keys(self):
        key = self.tag + "huge"
        over = self.metric("sluice_spend_over_limit_total", "tenant")
        answer = self.call(report("tenant", key, 5000))
        self.assertEqual(answer.overall_code, Code.OVER_LIMIT)
        self.assertEqual(self.metric("sluice_spend_over_limit_total", "tenant") - over, 5000)
        refused = self.call(check("tenant", key))
        self.assertEqual(refused.overall_code, Code.OVER_LIMIT)
        self.assertIn(refused.statuses[0].duration_until_reset.seconds, (239, 240))
        other = self.call(check("tenant", self.tag + "other"))
        self.assertEqual(other.overall_code, Code.OK)
        self.assertEqual(other.statuses[0].limit_remaining, 1000)

    def test_a_plain_refused_request_charges_nothing(self):
        key = self.tag + "plain"
        d = D(entries=[D.Entry(key="tenant", value=key)])
        plain = rls_pb2.RateLimitRequest(domain="usage", descriptors=[d], hits_addend=1200)
        self.assertEqual(self.call(plain).overall_code, Code.OVER_LIMIT)
        left = self.call(check("tenant", key)).statuses[0].limit_remaining
        self.assertEqual(left, 1000)


class Memory(Budgets, unittest.TestCase):
    tag = "m-"

    @classmethod
    def setUpClass(cls):
        cls.serve({}, redis=False)

    @classmethod
    def tearDownClass(cls):
        cls.stop()


@unittest.skipUnless(HAVE_REDIS, "redis-server is not installed")
class InRedis(Budgets, unittest.TestCase):
    tag = "r-"

    @classmethod
    def setUpClass(cls):
        cls.redis = Redis()
        cls.serve({"SLUICE_BACKEND": "redis",
                   "SLUICE_REDIS__URL": f"redis://127.0.0.1:{cls.redis.port}"}, redis=True)

    @classmethod
    def tearDownClass(cls):
        cls.stop()
        cls.redis.close()


if __name__ == "__main__":
    unittest.main()
