"""Checks of deploy/ that need no Docker, Kubernetes or Envoy binary.

- deploy/envoy/envoy.yaml parses strictly into Envoy's Bootstrap proto (xds-protos), the
  descriptors its routes produce are ones config/policies/edge.yaml limits, and its traces go to
  the collector the Compose file's sluice sends its own to.
- deploy/envoy/envoy-quota.yaml (the rate_limit_quota filter) parses strictly too, points at the
  sluice cluster over HTTP/2 with the policy's domain, and every bucket its matchers build is
  assigned a token bucket by a running sluice with config/policies (asked over RLQS with Envoy's
  generated client): each matches a limited rule.
- deploy/envoy/envoy-token-budget.yaml (a token budget charged when the response ends) parses
  strictly too; each route's pair of rate limits checks with hits_addend 0 and charges the
  tokens from dynamic metadata with apply_on_stream_done, and the policy in its header passes
  `sluice check` and limits the descriptor both send.
- deploy/envoy/envoy-delay.yaml (a rule that delays instead of refusing) parses strictly too;
  its rate-limit filter's timeout exceeds the longest delay of its policy
  (deploy/envoy/delay/) plus sluice's hold margin, and that policy passes `sluice check
  --strict` against that timeout (and warns against Envoy's default of 20 ms).
- The Kubernetes manifests, Prometheus config and Compose file parse, and the ConfigMap's
  policies pass `sluice check`.
- Every metric the Grafana dashboard queries is one sluice exposes (names from src/metrics/names.rs).
- The migration pair (deploy/kubernetes/migration): the sluice Deployment keeps every variable of
  the envoyproxy/ratelimit one unchanged, adds SLUICE_COMPAT, and with exactly that environment
  `sluice check` accepts the reference's ConfigMap laid out as the reference mounts it.

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_deploy.py -v
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

import grpc
import yaml
from google.protobuf import json_format

# Importing the typed_config messages registers them for Any resolution.
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.trace.v3 import opentelemetry_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from envoy.extensions.filters.http.rate_limit_quota.v3 import rate_limit_quota_pb2  # noqa: F401
from envoy.extensions.matching.common_inputs.network.v3 import network_inputs_pb2  # noqa: F401
from envoy.type.matcher.v3 import http_inputs_pb2  # noqa: F401
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_envoy_client import Server  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def path(*parts):
    return os.path.join(ROOT, *parts)


def load_yaml_docs(*parts):
    with open(path(*parts)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def sluice_check(policy_dir, *args):
    sluice = os.environ.get("SLUICE", path("target", "debug", "sluice"))
    return subprocess.run([sluice, "check", *args, policy_dir], capture_output=True, text=True)


def strict_hcm(config):
    """The first listener's HTTP connection manager of `config`, parsed strictly."""
    bootstrap = json_format.ParseDict(config, bootstrap_pb2.Bootstrap(), ignore_unknown_fields=False)
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    return hcm


# sluice's default margin between a hold's end and the caller's deadline
# (grpc.hold_deadline_margin_ms).
HOLD_MARGIN_NS = 5_000_000


def delay_ns(text):
    """A policy's `delay` (`250ms`, `1s`) in nanoseconds."""
    m = re.fullmatch(r"(\d+)(ms|s)", text)
    assert m, text
    return int(m.group(1)) * (1_000_000 if m.group(2) == "ms" else 1_000_000_000)


def delays(descriptors):
    """Every `rate_limit.delay` under a policy's descriptors, in nanoseconds."""
    for d in descriptors or []:
        limit = d.get("rate_limit") or {}
        if "delay" in limit:
            yield delay_ns(limit["delay"])
        yield from delays(d.get("descriptors"))


class Envoy(unittest.TestCase):
    def setUp(self):
        (self.config,) = load_yaml_docs("deploy", "envoy", "envoy.yaml")

    def test_parses_strictly_into_the_bootstrap_proto(self):
        bootstrap = json_format.ParseDict(self.config, bootstrap_pb2.Bootstrap(), ignore_unknown_fields=False)
        clusters = {c.name: c for c in bootstrap.static_resources.clusters}
        self.assertIn("ratelimit", clusters)
        self.assertEqual(len(bootstrap.static_resources.listeners), 1)

    def test_rate_limit_filter_points_at_sluice_over_v3(self):
        hcm = self.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        rl = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ratelimit")["typed_config"]
        self.assertEqual(rl["rate_limit_service"]["transport_api_version"], "V3")
        self.assertEqual(rl["rate_limit_service"]["grpc_service"]["envoy_grpc"]["cluster_name"], "ratelimit")
        self.assertFalse(rl["failure_mode_deny"])
        self.assertEqual(rl["enable_x_ratelimit_headers"], "DRAFT_VERSION_03")
        cluster = next(c for c in self.config["static_resources"]["clusters"] if c["name"] == "ratelimit")
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        self.assertIn("http2_protocol_options", options["explicit_http_config"])

    def test_envoy_and_sluice_trace_to_the_same_collector(self):
        hcm = self.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        provider = hcm["tracing"]["provider"]
        self.assertEqual(provider["name"], "envoy.tracers.opentelemetry")
        cluster_name = provider["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        cluster = next(c for c in self.config["static_resources"]["clusters"] if c["name"] == cluster_name)
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        self.assertIn("http2_protocol_options", options["explicit_http_config"])
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        address = address["socket_address"]
        (compose,) = load_yaml_docs("deploy", "docker-compose.yaml")
        sluice = compose["services"]["sluice"]["environment"]
        self.assertEqual(sluice["SLUICE_TRACING__ENABLED"], "true")
        self.assertEqual(
            sluice["SLUICE_TRACING__ENDPOINT"], f"http://{address['address']}:{address['port_value']}"
        )
        self.assertIn(address["address"], compose["services"])
        (collector,) = load_yaml_docs("deploy", "otel-collector", "config.yaml")
        grpc = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
        self.assertTrue(grpc.endswith(f":{address['port_value']}"), grpc)
        self.assertIn("otlp", collector["service"]["pipelines"]["traces"]["receivers"])

    def test_descriptors_match_the_shipped_policies(self):
        with open(path("config", "policies", "edge.yaml")) as f:
            policy = yaml.safe_load(f)
        hcm = self.config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        rl = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ratelimit")["typed_config"]
        self.assertEqual(rl["domain"], policy["domain"])
        top = {(d["key"], d.get("value")) for d in policy["descriptors"]}
        for rate_limit in hcm["route_config"]["virtual_hosts"][0]["rate_limits"]:
            first = rate_limit["actions"][0]
            if "remote_address" in first:
                entry = ("remote_address", None)
            elif "generic_key" in first:
                entry = ("generic_key", first["generic_key"]["descriptor_value"])
            else:
                entry = (first["request_headers"]["descriptor_key"], None)
            keys = {k for k, _ in top}
            self.assertTrue(entry in top or entry[0] in keys, f"{entry} is limited by no policy")


def quota_filter(config):
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.rate_limit_quota")["typed_config"]


# What a bucket entry built from a request reads, and a value it could read (one per action, so
# that the buckets of this test draw on distinct counters).
SAMPLES = {
    "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput": "{action}-7",
    "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput": "198.51.100.7",
}


def buckets(matcher):
    """Every bucket the filter's bucket_matchers can build: (action name, {key: value}), a
    request-built value replaced by a sample of what it reads."""
    actions = [m["on_match"]["action"] for m in matcher["matcher_list"]["matchers"]]
    if "on_no_match" in matcher:
        actions.append(matcher["on_no_match"]["action"])
    built = []
    for action in actions:
        entries = {}
        for key, value in action["typed_config"]["bucket_id_builder"]["bucket_id_builder"].items():
            if "string_value" in value:
                entries[key] = value["string_value"]
            else:
                sample = SAMPLES[value["custom_value"]["typed_config"]["@type"]]
                entries[key] = sample.format(action=action["name"])
        built.append((action["name"], entries))
    return built


class EnvoyTokenBudget(unittest.TestCase):
    def setUp(self):
        (self.config,) = load_yaml_docs("deploy", "envoy", "envoy-token-budget.yaml")

    def routes(self, bootstrap):
        hcm = http_connection_manager_pb2.HttpConnectionManager()
        bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
        return hcm, [r for vh in hcm.route_config.virtual_hosts for r in vh.routes]

    def test_parses_strictly_into_the_bootstrap_proto(self):
        bootstrap = json_format.ParseDict(self.config, bootstrap_pb2.Bootstrap(), ignore_unknown_fields=False)
        hcm, routes = self.routes(bootstrap)
        self.assertEqual([f.name for f in hcm.http_filters][-1], "envoy.filters.http.router")
        rl = rate_limit_pb2.RateLimit()
        self.assertTrue(hcm.http_filters[0].typed_config.Unpack(rl))
        self.assertEqual(rl.domain, "ai")
        self.assertEqual(rl.rate_limit_service.grpc_service.envoy_grpc.cluster_name, "ratelimit")
        self.assertTrue(routes)
        for route in routes:
            check, spend = route.route.rate_limits
            # The check: a cost of 0 before the request.
            self.assertTrue(check.HasField("hits_addend"))
            self.assertEqual(check.hits_addend.number.value, 0)
            self.assertFalse(check.apply_on_stream_done)
            # The spend: the tokens from the AI gateway's metadata, when the stream is done.
            self.assertTrue(spend.apply_on_stream_done)
            self.assertRegex(spend.hits_addend.format, r"^%DYNAMIC_METADATA\(io\.envoy\.ai_gateway:llm_total_token\)%$")
            self.assertEqual(json_format.MessageToDict(check.actions[0]), json_format.MessageToDict(spend.actions[0]))
            self.assertEqual(json_format.MessageToDict(check.actions[1]), json_format.MessageToDict(spend.actions[1]))

    def test_the_policy_in_its_header_passes_check_and_limits_the_descriptor(self):
        with open(path("deploy", "envoy", "envoy-token-budget.yaml")) as f:
            header = f.read().split("The policy it matches")[1].split("# Descriptors sent")[0]
        policy = "\n".join(line[4:] for line in header.splitlines()[1:])
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "ai.yaml"), "w") as f:
                f.write(policy)
            result = sluice_check(d)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("ai.generic_key_llm_tokens.tenant", result.stdout)
            self.assertIn("spend reported after the work", result.stdout)
        doc = yaml.safe_load(policy)
        self.assertEqual(doc["domain"], "ai")
        self.assertEqual(doc["descriptors"][0]["key"], "generic_key")
        self.assertEqual(doc["descriptors"][0]["descriptors"][0]["key"], "tenant")


class EnvoyDelay(unittest.TestCase):
    def setUp(self):
        (self.config,) = load_yaml_docs("deploy", "envoy", "envoy-delay.yaml")
        (self.policy,) = load_yaml_docs("deploy", "envoy", "delay", "vendor.yaml")

    def filter(self):
        hcm = strict_hcm(self.config)
        self.assertEqual([f.name for f in hcm.http_filters][-1], "envoy.filters.http.router")
        rl = rate_limit_pb2.RateLimit()
        self.assertTrue(hcm.http_filters[0].typed_config.Unpack(rl))
        routes = [r for vh in hcm.route_config.virtual_hosts for r in vh.routes]
        return rl, routes

    def test_parses_strictly_and_points_at_sluice_with_the_policys_domain(self):
        rl, routes = self.filter()
        self.assertEqual(rl.domain, self.policy["domain"])
        self.assertEqual(rl.rate_limit_service.grpc_service.envoy_grpc.cluster_name, "ratelimit")
        self.assertTrue(rl.failure_mode_deny, "a per-call-billed API fails closed")
        (route,) = routes
        (limit,) = route.route.rate_limits
        key = limit.actions[0].generic_key
        (rule,) = self.policy["descriptors"]
        self.assertEqual((key.descriptor_key, key.descriptor_value), (rule["key"], rule["value"]))

    def test_the_filter_timeout_exceeds_the_longest_delay_and_the_margin(self):
        rl, _ = self.filter()
        self.assertTrue(rl.HasField("timeout"), "Envoy's default of 20 ms would cut every hold short")
        timeout_ns = rl.timeout.seconds * 1_000_000_000 + rl.timeout.nanos
        longest = max(delays(self.policy["descriptors"]))
        self.assertGreater(longest, 0)
        self.assertGreater(timeout_ns, longest + HOLD_MARGIN_NS)
        # sluice check agrees with that timeout, and warns against Envoy's default.
        timeout = f"{timeout_ns // 1_000_000}ms"
        fits = sluice_check(path("deploy", "envoy", "delay"), "--strict", "--filter-timeout", timeout)
        self.assertEqual(fits.returncode, 0, fits.stderr)
        self.assertIn(f"checked against {timeout} (--filter-timeout): ok", fits.stdout)
        default = sluice_check(path("deploy", "envoy", "delay"))
        self.assertEqual(default.returncode, 0, default.stderr)
        self.assertIn("20ms (Envoy's default)", default.stderr)


class EnvoyQuota(unittest.TestCase):
    def setUp(self):
        (self.config,) = load_yaml_docs("deploy", "envoy", "envoy-quota.yaml")
        self.filter = quota_filter(self.config)

    def test_parses_strictly_into_the_bootstrap_proto(self):
        bootstrap = json_format.ParseDict(self.config, bootstrap_pb2.Bootstrap(), ignore_unknown_fields=False)
        hcm = http_connection_manager_pb2.HttpConnectionManager()
        bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
        self.assertEqual([f.name for f in hcm.http_filters][-1], "envoy.filters.http.router")
        config = rate_limit_quota_pb2.RateLimitQuotaFilterConfig()
        self.assertTrue(hcm.http_filters[0].typed_config.Unpack(config))
        self.assertEqual(len(config.bucket_matchers.matcher_list.matchers), 2)
        for matcher in config.bucket_matchers.matcher_list.matchers:
            settings = rate_limit_quota_pb2.RateLimitQuotaBucketSettings()
            self.assertTrue(matcher.on_match.action.typed_config.Unpack(settings))
            self.assertGreater(settings.reporting_interval.seconds, 0)
            self.assertEqual(settings.no_assignment_behavior.fallback_rate_limit.blanket_rule, 0)  # ALLOW_ALL
            self.assertEqual(settings.deny_response_settings.http_status.code, 429)
            # An expired assignment is reused for a bounded time, at most sluice's default TTL
            # (10 s): the bound then reads with TTL plus that timeout.
            expired = settings.expired_assignment_behavior
            self.assertTrue(expired.HasField("reuse_last_assignment"))
            self.assertTrue(expired.HasField("expired_assignment_behavior_timeout"))
            self.assertLessEqual(expired.expired_assignment_behavior_timeout.seconds, 10)

    def test_the_filter_points_at_sluice_over_http2(self):
        cluster_name = self.filter["rlqs_server"]["envoy_grpc"]["cluster_name"]
        cluster = next(c for c in self.config["static_resources"]["clusters"] if c["name"] == cluster_name)
        options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        self.assertIn("http2_protocol_options", options["explicit_http_config"])
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        (compose,) = load_yaml_docs("deploy", "docker-compose.yaml")
        self.assertEqual(address["socket_address"]["address"], "sluice")
        self.assertIn("sluice", compose["services"])
        self.assertEqual(address["socket_address"]["port_value"], 8081)
        check = cluster["health_checks"][0]["grpc_health_check"]["service_name"]
        self.assertEqual(check, "envoy.service.rate_limit_quota.v3.RateLimitQuotaService")
        with open(path("config", "policies", "edge.yaml")) as f:
            self.assertEqual(self.filter["domain"], yaml.safe_load(f)["domain"])

    def test_every_bucket_matches_a_limited_rule_of_the_policy(self):
        built = buckets(self.filter["bucket_matchers"])
        self.assertEqual([name for name, _ in built], ["user_search", "user", "per_ip"])
        with open(path("config", "policies", "edge.yaml")) as f:
            server = Server(policy=f.read())
        try:
            self.assertEqual(sluice_check(path("config", "policies")).returncode, 0)
            usages = []
            for _, entries in built:
                usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage(
                    bucket_id=rlqs_pb2.BucketId(bucket=entries), num_requests_allowed=1000)
                usage.time_elapsed.seconds = 1
                usages.append(usage)
            first = rlqs_pb2.RateLimitQuotaUsageReports(domain=self.filter["domain"], bucket_quota_usages=usages)
            stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(server.channel)
            call = stub.StreamRateLimitQuotas(iter([first]), timeout=10)
            answer = next(call)
            call.cancel()
            assigned = {}
            for action in answer.bucket_action:
                strategy = action.quota_assignment_action.rate_limit_strategy
                self.assertEqual(strategy.WhichOneof("strategy"), "token_bucket", action)
                b = strategy.token_bucket
                interval = b.fill_interval.seconds + b.fill_interval.nanos / 1e9
                assigned[tuple(sorted(action.bucket_id.bucket.items()))] = b.tokens_per_fill.value / interval
            self.assertEqual(len(assigned), len(built), answer)
            rate = {name: assigned[tuple(sorted(entries.items()))] for name, entries in built}
            # A lone stream asking for more than the rule gets all of it: user_minute is 1000 a
            # minute, a search costs 10; per_ip is 10 a second.
            self.assertAlmostEqual(rate["user"], 1000 / 60, delta=0.5)
            self.assertAlmostEqual(rate["user_search"], 100 / 60, delta=0.1)
            self.assertAlmostEqual(rate["per_ip"], 10, delta=0.1)
        except grpc.RpcError as e:
            self.fail(f"sluice refused the stream: {e}")
        finally:
            server.close()


class Manifests(unittest.TestCase):
    def test_kubernetes_manifests(self):
        for name in ("sluice.yaml", "sluice-redis.yaml"):
            docs = load_yaml_docs("deploy", "kubernetes", name)
            kinds = [d["kind"] for d in docs]
            self.assertIn("Deployment", kinds, name)
            for d in docs:
                self.assertIn("apiVersion", d)
                self.assertIn("name", d["metadata"])
                if d["kind"] == "Deployment" and d["metadata"]["name"] == "sluice":
                    container = d["spec"]["template"]["spec"]["containers"][0]
                    self.assertEqual(container["readinessProbe"]["grpc"]["port"], 8081)
                    self.assertIn("resources", container)
                    mounts = {m["mountPath"] for m in container["volumeMounts"]}
                    self.assertIn("/etc/sluice/policies", mounts)

    def test_configmap_policies_pass_sluice_check(self):
        (configmap,) = [d for d in load_yaml_docs("deploy", "kubernetes", "sluice.yaml") if d["kind"] == "ConfigMap"]
        with tempfile.TemporaryDirectory() as tmp:
            for file, text in configmap["data"].items():
                with open(os.path.join(tmp, file), "w") as f:
                    f.write(text)
            result = sluice_check(tmp)
            self.assertEqual(result.returncode, 0, result.stderr)

    def test_prometheus_and_compose_parse(self):
        (prom,) = load_yaml_docs("deploy", "prometheus", "prometheus.yml")
        self.assertIn("sluice", [j["job_name"] for j in prom["scrape_configs"]])
        (compose,) = load_yaml_docs("deploy", "docker-compose.yaml")
        self.assertEqual(
            set(compose["services"]), {"envoy", "backend", "sluice", "redis", "prometheus", "otel-collector"}
        )


def container_of(docs, kind="Deployment"):
    (deployment,) = [d for d in docs if d["kind"] == kind]
    return deployment["spec"]["template"]["spec"]["containers"][0]


class Migration(unittest.TestCase):
    def setUp(self):
        self.before = load_yaml_docs("deploy", "kubernetes", "migration", "before-envoy-ratelimit.yaml")
        self.after = load_yaml_docs("deploy", "kubernetes", "migration", "after-sluice.yaml")

    def env(self, docs):
        return {e["name"]: e["value"] for e in container_of(docs)["env"]}

    def test_the_reference_variables_are_kept_and_compat_is_added(self):
        before, after = self.env(self.before), self.env(self.after)
        self.assertEqual(after.get("SLUICE_COMPAT"), "envoy-ratelimit")
        self.assertFalse(any(k.startswith("SLUICE_") for k in before))
        reference = {k: v for k, v in after.items() if not k.startswith("SLUICE_")}
        self.assertEqual(reference, before)
        # No flag that would override the reference's directory or backend: the image's
        # entrypoint (a settings file and example policies) is replaced by a bare `serve`.
        self.assertNotIn("args", container_of(self.after))
        self.assertEqual(container_of(self.after)["command"], ["/usr/local/bin/sluice", "serve"])
        with open(path("deploy", "Dockerfile")) as f:
            dockerfile = f.read()
        self.assertRegex(dockerfile, r"(?m)^COPY --from=build \S+ /usr/local/bin/sluice$")
        self.assertRegex(dockerfile, r'(?m)^ENTRYPOINT \["/usr/local/bin/sluice", "serve", "--config"')
        self.assertEqual(container_of(self.before)["volumeMounts"], container_of(self.after)["volumeMounts"])

    def test_the_sluice_deployment_probes_grpc_and_keeps_the_ports_and_the_scrape(self):
        container = container_of(self.after)
        self.assertEqual(container["readinessProbe"]["grpc"], {"port": 8081, "service": "ratelimit"})
        # The same ports (USE_PROMETHEUS opens 9090, the debug port 6070) and scrape target.
        self.assertEqual(container["ports"], container_of(self.before)["ports"])
        annotations = [
            next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["metadata"]["annotations"]
            for docs in (self.before, self.after)
        ]
        self.assertEqual(annotations[0], annotations[1])

    def test_sluice_check_accepts_the_configmap_under_the_reference_environment(self):
        (configmap,) = [d for d in self.before if d["kind"] == "ConfigMap"]
        self.assertTrue(any("." not in name for name in configmap["data"]), "a file without an extension")
        env = self.env(self.after)
        with tempfile.TemporaryDirectory() as tmp:
            # The layout a ConfigMap mount makes: the files are symlinks into ..data.
            config = os.path.join(tmp, env["RUNTIME_SUBDIRECTORY"], "config")
            data = os.path.join(config, "..2026_01_01_00_00_00.000000000")
            os.makedirs(data)
            os.symlink(os.path.basename(data), os.path.join(config, "..data"))
            for file, text in configmap["data"].items():
                with open(os.path.join(data, file), "w") as f:
                    f.write(text)
                os.symlink(os.path.join("..data", file), os.path.join(config, file))
            env["RUNTIME_ROOT"] = tmp
            sluice = os.environ.get("SLUICE", path("target", "debug", "sluice"))
            result = subprocess.run([sluice, "check"], capture_output=True, text=True, env=env)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("2 domains", result.stdout)
            # USE_PROMETHEUS is read (the metrics listener), not warned about.
            self.assertNotIn("USE_PROMETHEUS", result.stderr)


class Dashboard(unittest.TestCase):
    def test_every_queried_metric_exists(self):
        with open(path("src", "metrics", "names.rs")) as f:
            known = set(re.findall(r'pub const [A-Z_]+: &str = "([a-z_]+)";', f.read()))
        self.assertIn("sluice_decisions_total", known)
        with open(path("deploy", "grafana", "sluice.json")) as f:
            dashboard = json.load(f)
        used = set()
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                used |= set(re.findall(r"\b((?:sluice|ratelimit)_[a-z_]+)", target["expr"]))
        self.assertTrue(used)
        for name in used:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            self.assertTrue(name in known or base in known, f"{name} is not a sluice metric")


if __name__ == "__main__":
    unittest.main()
