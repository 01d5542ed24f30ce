"""Interop: sluice answers Envoy's own generated client (PyPI xds-protos + grpcio) correctly.

Starts the sluice binary named by $SLUICE (one server per response-header mode) on free
loopback ports with the policies below, and checks, through the stubs Envoy's API generates:
domains, nested descriptors, request and per-descriptor hits_addend (the UInt64Value wrapper),
is_negative_hits (field 4, newer than xds-protos: appended as raw bytes), override limits, every
response field, the headers of each mode, the dynamic metadata in envoyproxy/ratelimit's shape,
and INVALID_ARGUMENT for bad input.

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_envoy_client.py -v
"""

import json
import os
import subprocess
import tempfile
import time
import unittest

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from envoy.type.v3 import ratelimit_unit_pb2

POLICY = """
domain: interop
descriptors:
  - key: remote_address
    rate_limit: {name: per_ip, unit: second, requests_per_unit: 10, burst: 20}
  - key: generic_key
    value: api
    descriptors:
      - key: api_key
        rate_limit: {name: per_key, unit: minute, requests_per_unit: 3}
  - key: internal
    rate_limit: {unlimited: true}
  - key: weekly
    rate_limit: {name: weekly, unit: week, requests_per_unit: 7}
  - key: service
    value: service_1
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {service_with_quota: {name: "service_1"}, tier: 1}
  - key: service
    value: service_2
    rate_limit: {unit: minute, requests_per_unit: 5}
    metadata: {service_with_quota: {name: "service_2"}, backup: true}
"""

Code = rls_pb2.RateLimitResponse.Code
Unit = rls_pb2.RateLimitResponse.RateLimit.Unit
D = ratelimit_pb2.RateLimitDescriptor


def descriptor(*entries, hits=None):
    d = D(entries=[D.Entry(key=k, value=v) for k, v in entries])
    if hits is not None:
        d.hits_addend.value = hits
    return d


class Server:
    """A sluice process on free ports; its bound addresses are read from its JSON log."""

    def __init__(self, headers="none", env=None, policy=POLICY):
        self.dir = tempfile.TemporaryDirectory()
        with open(os.path.join(self.dir.name, "interop.yaml"), "w") as f:
            f.write(policy)
        self.proc = subprocess.Popen(
            [os.environ.get("SLUICE", "target/debug/sluice"), "serve",
             "--policies", self.dir.name, "--grpc-addr", "127.0.0.1:0",
             "--admin-addr", "127.0.0.1:0", "--log-format", "json",
             "--response-headers", headers],
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "RUST_LOG": "info", **(env or {})})
        deadline = time.time() + 30
        self.grpc = None
        while self.grpc is None:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("sluice did not start")
            line = self.proc.stderr.readline()
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("message") == "serving":
                self.grpc, self.admin = event["grpc"], event["admin"]
        self.channel = grpc.insecure_channel(self.grpc)
        self.stub = rls_pb2_grpc.RateLimitServiceStub(self.channel)

    def call(self, domain, *descriptors, hits=0):
        req = rls_pb2.RateLimitRequest(domain=domain, descriptors=descriptors, hits_addend=hits)
        return self.stub.ShouldRateLimit(req, timeout=5)

    def call_raw(self, payload):
        """ShouldRateLimit with a hand-encoded request (for fields xds-protos lacks)."""
        method = self.channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            request_serializer=lambda b: b,
            response_deserializer=rls_pb2.RateLimitResponse.FromString)
        return method(payload, timeout=5)

    def close(self):
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(timeout=15)
        self.proc.stderr.close()
        self.dir.cleanup()


class Decisions(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = Server()

    @classmethod
    def tearDownClass(cls):
        cls.s.close()

    def test_every_field_of_a_limited_status(self):
        r = self.s.call("interop", descriptor(("remote_address", "10.0.0.1")))
        self.assertEqual(r.overall_code, Code.OK)
        self.assertEqual(len(r.statuses), 1)
        st = r.statuses[0]
        self.assertEqual(st.code, Code.OK)
        self.assertEqual(st.current_limit.name, "per_ip")
        self.assertEqual(st.current_limit.requests_per_unit, 10)
        self.assertEqual(st.current_limit.unit, Unit.SECOND)
        self.assertEqual(st.limit_remaining, 19)
        self.assertEqual(st.duration_until_reset.seconds, 1)
        self.assertEqual(st.duration_until_reset.nanos, 0)

    def test_nested_descriptors_and_over_limit(self):
        d = descriptor(("generic_key", "api"), ("api_key", "k-nested"))
        for remaining in (2, 1, 0):
            r = self.s.call("interop", d)
            self.assertEqual(r.overall_code, Code.OK)
            self.assertEqual(r.statuses[0].limit_remaining, remaining)
            self.assertEqual(r.statuses[0].current_limit.unit, Unit.MINUTE)
        r = self.s.call("interop", d)
        self.assertEqual(r.overall_code, Code.OVER_LIMIT)
        self.assertEqual(r.statuses[0].code, Code.OVER_LIMIT)
        self.assertEqual(r.statuses[0].duration_until_reset.seconds, 20)

    def test_unknown_domain_unmatched_and_unlimited(self):
        r = self.s.call("nope", descriptor(("remote_address", "10.0.0.2")))
        self.assertEqual(r.overall_code, Code.OK)
        self.assertFalse(r.statuses[0].HasField("current_limit"))
        self.assertEqual(r.statuses[0].limit_remaining, 0)
        r = self.s.call("interop", descriptor(("internal", "batch")), descriptor(("other", "x")))
        self.assertEqual([s.limit_remaining for s in r.statuses], [4294967295, 0])
        self.assertFalse(r.statuses[0].HasField("current_limit"))

    def test_week_is_unit_seven(self):
        r = self.s.call("interop", descriptor(("weekly", "w")))
        self.assertEqual(r.statuses[0].current_limit.unit, Unit.WEEK)
        self.assertEqual(int(Unit.WEEK), 7)

    def test_hits_addend_request_and_descriptor(self):
        d = lambda **kw: descriptor(("generic_key", "api"), ("api_key", "k-hits"), **kw)
        r = self.s.call("interop", d(), hits=0)  # 0 means 1
        self.assertEqual(r.statuses[0].limit_remaining, 2)
        r = self.s.call("interop", d(hits=0), hits=5)  # the wrapper wins, even at 0
        self.assertEqual(r.statuses[0].limit_remaining, 2)
        r = self.s.call("interop", d(hits=2))
        self.assertEqual(r.statuses[0].limit_remaining, 0)

    def test_negative_hits_field_four_refunds(self):
        d = descriptor(("generic_key", "api"), ("api_key", "k-refund"), hits=3)
        self.assertEqual(self.s.call("interop", d).statuses[0].limit_remaining, 0)
        # xds-protos predates is_negative_hits: append field 4 (tag 0x20, varint 1) by hand.
        refund = descriptor(("generic_key", "api"), ("api_key", "k-refund"), hits=2)
        inner = refund.SerializeToString() + b"\x20\x01"
        req = rls_pb2.RateLimitRequest(domain="interop").SerializeToString()
        req += b"\x12" + bytes([len(inner)]) + inner
        r = self.s.call_raw(req)
        self.assertEqual(r.statuses[0].limit_remaining, 2)

    def test_override_limit(self):
        d = descriptor(("anything", "o"))
        d.limit.requests_per_unit = 1
        d.limit.unit = ratelimit_unit_pb2.HOUR
        self.assertEqual(self.s.call("interop", d).overall_code, Code.OK)
        r = self.s.call("interop", d)
        self.assertEqual(r.overall_code, Code.OVER_LIMIT)
        self.assertEqual(r.statuses[0].current_limit.unit, Unit.HOUR)
        self.assertEqual(r.statuses[0].current_limit.requests_per_unit, 1)

    def test_no_dynamic_metadata_unless_asked(self):
        r = self.s.call("interop", descriptor(("service", "service_2")))
        self.assertFalse(r.HasField("dynamic_metadata"))

    def test_bad_input_is_invalid_argument(self):
        cases = [
            ("", [descriptor(("a", "b"))]),
            ("interop", []),
            ("interop", [descriptor(("", "b"))]),
            ("interop", [descriptor()]),
        ]
        for domain, descriptors in cases:
            with self.assertRaises(grpc.RpcError) as err:
                self.s.call(domain, *descriptors)
            self.assertEqual(err.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertTrue(err.exception.details())


class DynamicMetadata(unittest.TestCase):
    """`dynamic_metadata` read as Envoy's filter reads it: a google.protobuf.Struct."""

    @classmethod
    def setUpClass(cls):
        cls.s = Server(env={"SLUICE_RESPONSE_DYNAMIC_METADATA": "true"})

    @classmethod
    def tearDownClass(cls):
        cls.s.close()

    def test_the_reference_shape(self):
        from google.protobuf import json_format, struct_pb2
        both = (descriptor(("service", "service_1")), descriptor(("service", "service_2"), hits=1))
        r = self.s.call("interop", *both, hits=2)
        self.assertEqual(r.overall_code, Code.OK)
        md = r.dynamic_metadata
        self.assertIsInstance(md, struct_pb2.Struct)
        self.assertEqual(md.fields["domain"].string_value, "interop")
        descs = md.fields["descriptors"].list_value.values
        entries = [[e.string_value for e in d.struct_value.fields["entries"].list_value.values]
                   for d in descs]
        self.assertEqual(entries, [["service=service_1"], ["service=service_2"]])
        self.assertNotIn("hitsAddend", descs[0].struct_value.fields)
        self.assertEqual(descs[1].struct_value.fields["hitsAddend"].number_value, 1)
        self.assertEqual(md.fields["hitsAddend"].number_value, 2)
        meta = md.fields["metadata"].struct_value
        # Both passed: merged, the first descriptor's value winning where both have one.
        self.assertEqual(meta.fields["service_with_quota"].struct_value.fields["name"].string_value,
                         "service_1")
        self.assertEqual(meta.fields["tier"].number_value, 1)
        self.assertTrue(meta.fields["backup"].bool_value)
        # service_1 is spent (its 2 drawn by the request's hitsAddend), so the next request is
        # refused and only service_2's metadata remains.
        r = self.s.call("interop", *both)
        self.assertEqual(r.overall_code, Code.OVER_LIMIT)
        as_dict = json_format.MessageToDict(r.dynamic_metadata)
        self.assertEqual(as_dict["metadata"], {"service_with_quota": {"name": "service_2"},
                                               "backup": True})
        self.assertNotIn("hitsAddend", as_dict)

    def test_an_override_is_described_as_text(self):
        d = descriptor(("anything", "md"))
        d.limit.requests_per_unit = 10
        d.limit.unit = ratelimit_unit_pb2.MINUTE
        r = self.s.call("interop", d)
        desc = r.dynamic_metadata.fields["descriptors"].list_value.values[0].struct_value
        self.assertEqual(desc.fields["limit"].string_value, "requests_per_unit:10 unit:MINUTE")
        self.assertNotIn("metadata", r.dynamic_metadata.fields)


class Headers(unittest.TestCase):
    def headers(self, mode, key):
        s = Server(mode)
        try:
            d = descriptor(("generic_key", "api"), ("api_key", key))
            first = s.call("interop", d)
            for _ in range(2):
                s.call("interop", d)
            denied = s.call("interop", d)
            return ({h.key: h.value for h in first.response_headers_to_add},
                    {h.key: h.value for h in denied.response_headers_to_add})
        finally:
            s.close()

    def test_draft(self):
        ok, denied = self.headers("draft", "k-draft")
        self.assertEqual(ok["RateLimit-Policy"], '"per_key";q=3;w=60')
        self.assertEqual(ok["RateLimit"], '"per_key";r=2;t=20')
        self.assertNotIn("Retry-After", ok)
        self.assertEqual(denied["RateLimit"], '"per_key";r=0;t=20')
        self.assertGreaterEqual(int(denied["Retry-After"]), 20)

    def test_legacy(self):
        ok, denied = self.headers("legacy", "k-legacy")
        self.assertEqual((ok["RateLimit-Limit"], ok["RateLimit-Remaining"], ok["RateLimit-Reset"]), ("3", "2", "20"))
        self.assertEqual(denied["RateLimit-Remaining"], "0")
        self.assertGreaterEqual(int(denied["Retry-After"]), 20)

    def test_none(self):
        ok, denied = self.headers("none", "k-none")
        self.assertEqual((ok, denied), ({}, {}))


if __name__ == "__main__":
    unittest.main()
