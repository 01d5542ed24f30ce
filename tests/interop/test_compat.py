"""Interop: sluice started as an envoyproxy/ratelimit Deployment starts it, called with Envoy's
generated client (PyPI xds-protos + grpcio).

One server gets nothing but the reference's environment (and `SLUICE_COMPAT`) over the
reference's runtime layout, made here from tests/fixtures/envoy-ratelimit: `RUNTIME_ROOT` a
symlink `current` to `v1`, policies in `ratelimit/config` in files without a `.yaml` extension,
and a dot file that is not YAML. `BACKEND_TYPE` is left unset, as most reference Deployments
leave it: Redis is the reference's default. A second server gets the equivalent sluice settings.
Both count in one redis-server started here, each under its own key prefix.

Checked: every answer of the first is the second's (nested, key-only, exact, unlimited and
unknown-domain descriptors, the legacy headers under a custom name, limits run past their end);
the reference server counted in Redis; the files without an extension were read and the dot
file skipped; and after the root's symlink is swapped to `v2` under the running server, its
answers follow the new limits without a restart.

Without redis-server the tests skip with a notice, except on CI (env CI set), where they fail.

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_compat.py -v
"""

import os
import shutil
import sys
import tempfile
import time
import unittest

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Redis, Sluice, have_redis  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                       "envoy-ratelimit")
# The reference's runtime is re-scanned every 2 s, then debounced; a slow 2-core machine.
SWAP_WITHIN = 10.0

HAVE_REDIS = have_redis("test_compat")

D = ratelimit_pb2.RateLimitDescriptor
Code = rls_pb2.RateLimitResponse.Code


def request(domain, *descriptors):
    return rls_pb2.RateLimitRequest(
        domain=domain,
        descriptors=[D(entries=[D.Entry(key=k, value=v) for k, v in d]) for d in descriptors])


def requests():
    """Nested, key-only, exact, whitelisted, unlimited, unknown domain, too deep, two
    descriptors, and limits run past their end."""
    out = [
        request("test-domain", [("key1", "value1"), ("subkey1", "x")]),
        request("test-domain", [("key1", "value1"), ("subkey1", "subvalue1")]),
        request("test-domain", [("key2", "any")]),
        request("test-domain", [("key2", "value2")]),
        request("test-domain", [("key2", "value3")]),
        request("test-domain", [("key6", "x")]),
        request("nowhere", [("key1", "value1")]),
        request("test-domain", [("key2", "value2"), ("deeper", "x")]),
        request("test-domain", [("key4", "a")], [("key3", "b")]),
    ]
    for _ in range(2):
        out.append(request("test-domain", [("key3", "b")]))
        out.append(request("test-domain", [("key4", "a")]))
    out.append(request("mongo_cps", [("database", "users")]))
    return out


def without_retry_after(response):
    """`Retry-After` is spread by a random jitter on each denial; all else must match."""
    kept = [h for h in response.response_headers_to_add if h.key != "Retry-After"]
    del response.response_headers_to_add[:]
    response.response_headers_to_add.extend(kept)
    return response


@unittest.skipUnless(HAVE_REDIS, "redis-server is not installed")
class ReferenceEnvironment(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        root = os.path.join(self.dir.name, "runtime")
        for version in ("v1", "v2"):
            shutil.copytree(os.path.join(FIXTURE, version), os.path.join(root, version))
        os.symlink("v1", os.path.join(root, "current"))
        self.root = root
        self.redis = Redis()
        self.addCleanup(self.redis.close)
        self.addCleanup(self.dir.cleanup)
        current = os.path.join(root, "current")
        # Decisions are compared, not Redis's latency: on a loaded machine an answer may come
        # past the default 10 ms, which both servers would answer UNAVAILABLE.
        patience = {"SLUICE_REDIS__TIMEOUT_MS": "1000"}
        self.reference = Sluice({
            **patience,
            "SLUICE_COMPAT": "envoy-ratelimit",
            "HOST": "127.0.0.1", "PORT": "0", "GRPC_HOST": "127.0.0.1", "GRPC_PORT": "0",
            "DEBUG_HOST": "127.0.0.1", "DEBUG_PORT": "0", "PROMETHEUS_ADDR": "127.0.0.1:0",
            "LOG_FORMAT": "json", "LOG_LEVEL": "info",
            "RUNTIME_ROOT": current, "RUNTIME_SUBDIRECTORY": "ratelimit",
            "RUNTIME_IGNOREDOTFILES": "true", "RUNTIME_WATCH_ROOT": "true",
            "REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": f"127.0.0.1:{self.redis.port}",
            "CACHE_KEY_PREFIX": "reference_",
            "USE_STATSD": "false", "USE_PROMETHEUS": "true",
            "LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_REMAINING_HEADER": "X-RateLimit-Left",
            "NEAR_LIMIT_RATIO": "0.5", "SHADOW_MODE": "false",
        })
        self.addCleanup(self.reference.close)
        self.native = Sluice({
            **patience,
            "SLUICE_GRPC_ADDR": "127.0.0.1:0", "SLUICE_ADMIN_ADDR": "127.0.0.1:0",
            "SLUICE_LOG_FORMAT": "json",
            "SLUICE_POLICIES": os.path.join(current, "ratelimit", "config"),
            "SLUICE_POLICY_FILES": "visible",
            "SLUICE_BACKEND": "redis", "SLUICE_REDIS__URL": f"redis://127.0.0.1:{self.redis.port}",
            "SLUICE_REDIS__KEY_PREFIX": "native_",
            "SLUICE_RESPONSE_HEADERS": "legacy",
            "SLUICE_LEGACY_HEADERS__REMAINING": "X-RateLimit-Left",
            "SLUICE_METRICS__NEAR_LIMIT_RATIO": "0.5",
        })
        self.addCleanup(self.native.close)

    def users_limit(self):
        status = self.reference.call(request("mongo_cps", [("database", "users")])).statuses[0]
        return status.current_limit.requests_per_unit

    def test_decides_as_sluice_settings_do_in_redis_and_follows_a_root_swap(self):
        # A counter no compared request uses.
        for server in (self.reference, self.native):
            server.warm(request("mongo_cps", [("database", "default")]))
        limited = 0
        for req in requests():
            a = without_retry_after(self.reference.call(req))
            b = without_retry_after(self.native.call(req))
            self.assertEqual(a, b, req)
            if len(a.response_headers_to_add) > 1:
                self.assertEqual(a.response_headers_to_add[1].key, "X-RateLimit-Left")
            limited += sum(1 for s in a.statuses if s.HasField("current_limit"))
        self.assertGreaterEqual(limited, 10, "the fixture's limits were applied")
        # The runs past a limit's end were refused.
        over = self.reference.call(request("test-domain", [("key3", "b")]))
        self.assertEqual(over.overall_code, Code.OVER_LIMIT)
        # BACKEND_TYPE unset is the reference's default: the counters are in Redis.
        self.assertIn(b"reference_", self.redis.keys("reference_*"))
        self.assertIn(b"native_", self.redis.keys("native_*"))
        # Both extensionless files were read, and the dot file (not YAML) skipped.
        rlconfig = self.reference.get("/rlconfig")
        self.assertIn("mongo_cps", rlconfig)
        self.assertIn("test-domain", rlconfig)
        self.assertEqual(self.users_limit(), 500)
        # The root swapped to v2 under the running server, as the reference's deployments do
        # it: a new symlink renamed over `current`.
        os.symlink("v2", os.path.join(self.root, "next"))
        os.rename(os.path.join(self.root, "next"), os.path.join(self.root, "current"))
        deadline = time.time() + SWAP_WITHIN
        while self.users_limit() != 2:
            self.assertLess(time.time(), deadline, "the swap of RUNTIME_ROOT was followed")
            time.sleep(0.2)
        self.assertEqual(self.reference.proc.poll(), None, "no restart")


if __name__ == "__main__":
    unittest.main()
