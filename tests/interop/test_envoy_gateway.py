"""Envoy Gateway's rate-limit files in deploy/envoy-gateway/, parsed strictly.

- envoy-gateway-config.yaml (the ConfigMap holding Envoy Gateway's `EnvoyGateway` config) parses
  strictly against the fields it may use, and swaps the rate-limit image to sluice.
- ratelimit-deployment.yaml parses strictly: the Deployment Envoy Gateway renders, its command
  `/bin/ratelimit`, every variable in Envoy Gateway's order, its mounts, ports, probes and
  security context; only the image differs. The image (deploy/Dockerfile) has `/bin/ratelimit`
  and runs as 65534.

The binary started with that Deployment's environment, its policies pushed over mTLS by a
management server shaped like Envoy Gateway's, is `envoy_gateways_deployment_takes_policies_over_xds`
in tests/it/xds.rs (`cargo test --test it -- xds`).

Run: python3 -m unittest tests/interop/test_envoy_gateway.py -v
"""

import os
import unittest

import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")

# Envoy Gateway's variables, in the order it renders them (internal/infrastructure/kubernetes/
# ratelimit/resource.go), with a Redis backend and Prometheus on.
EG_ENV = [
    "RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_IGNOREDOTFILES", "RUNTIME_WATCH_ROOT",
    "LOG_LEVEL", "USE_STATSD", "CONFIG_TYPE", "CONFIG_GRPC_XDS_SERVER_URL",
    "CONFIG_GRPC_XDS_NODE_ID", "GRPC_SERVER_USE_TLS", "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY", "GRPC_SERVER_TLS_CA_CERT", "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
    "CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "FORCE_START_WITHOUT_INITIAL_CONFIG",
    "REDIS_SOCKET_TYPE", "REDIS_URL", "USE_PROMETHEUS", "PROMETHEUS_ADDR",
    "PROMETHEUS_MAPPER_YAML",
]


def load(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def strict(test, value, schema, where="$"):
    """Fails `test` when `value` has a key `schema` does not name (at any depth). A schema is a
    dict of key -> sub-schema, a one-item list for a list of such, or None for a leaf."""
    if schema is None:
        return
    if isinstance(schema, list):
        test.assertIsInstance(value, list, where)
        for i, item in enumerate(value):
            strict(test, item, schema[0], f"{where}[{i}]")
        return
    test.assertIsInstance(value, dict, where)
    for key, sub in value.items():
        test.assertIn(key, schema, f"{where}: unknown field {key!r}")
        strict(test, sub, schema[key], f"{where}.{key}")


PROBE = {"httpGet": {"path": None, "port": None, "scheme": None}, "periodSeconds": None,
         "timeoutSeconds": None, "successThreshold": None, "failureThreshold": None}
LABELS = {"app.kubernetes.io/name": None, "app.kubernetes.io/component": None,
          "app.kubernetes.io/managed-by": None}
DEPLOYMENT = {
    "apiVersion": None, "kind": None,
    "metadata": {"name": None, "namespace": None, "labels": LABELS},
    "spec": {
        "replicas": None, "selector": {"matchLabels": LABELS},
        "strategy": {"type": None, "rollingUpdate": {"maxSurge": None, "maxUnavailable": None}},
        "template": {
            "metadata": {"labels": LABELS, "annotations": {
                "prometheus.io/scrape": None, "prometheus.io/port": None, "prometheus.io/path": None}},
            "spec": {
                "serviceAccountName": None, "automountServiceAccountToken": None,
                "terminationGracePeriodSeconds": None,
                "containers": [{
                    "name": None, "image": None, "imagePullPolicy": None, "command": None,
                    "env": [{"name": None, "value": None}],
                    "ports": [{"name": None, "containerPort": None, "protocol": None}],
                    "startupProbe": PROBE, "readinessProbe": PROBE, "livenessProbe": PROBE,
                    "resources": {"requests": {"cpu": None, "memory": None}},
                    "securityContext": {
                        "allowPrivilegeEscalation": None, "capabilities": {"drop": None},
                        "privileged": None, "readOnlyRootFilesystem": None, "runAsGroup": None,
                        "runAsNonRoot": None, "runAsUser": None, "seccompProfile": {"type": None}},
                    "terminationMessagePath": None, "terminationMessagePolicy": None,
                    "volumeMounts": [{"name": None, "mountPath": None, "readOnly": None}],
                }],
                "volumes": [{"name": None,
                             "secret": {"secretName": None, "defaultMode": None},
                             "configMap": {"name": None, "defaultMode": None, "optional": None}}],
            },
        },
    },
}
ENVOY_GATEWAY = {
    "apiVersion": None, "kind": None,
    "gateway": {"controllerName": None},
    "logging": {"level": {"default": None}},
    "provider": {"type": None, "kubernetes": {"rateLimitDeployment": {"container": {"image": None}}}},
    "rateLimit": {"backend": {"type": None, "redis": {"url": None}}},
}


def container(deployment):
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


class Files(unittest.TestCase):
    def setUp(self):
        (self.config,) = load("deploy", "envoy-gateway", "envoy-gateway-config.yaml")
        (self.deployment,) = load("deploy", "envoy-gateway", "ratelimit-deployment.yaml")

    def test_the_envoy_gateway_config_swaps_the_rate_limit_image(self):
        self.assertEqual((self.config["kind"], self.config["metadata"]["name"]),
                         ("ConfigMap", "envoy-gateway-config"))
        eg = yaml.safe_load(self.config["data"]["envoy-gateway.yaml"])
        strict(self, eg, ENVOY_GATEWAY)
        self.assertEqual((eg["apiVersion"], eg["kind"]), ("gateway.envoyproxy.io/v1alpha1", "EnvoyGateway"))
        image = eg["provider"]["kubernetes"]["rateLimitDeployment"]["container"]["image"]
        self.assertEqual(image, container(self.deployment)["image"])
        self.assertIn("sluice", image)
        self.assertEqual(eg["rateLimit"]["backend"]["type"], "Redis")

    def test_the_deployment_is_envoy_gateways_with_the_image_swapped(self):
        strict(self, self.deployment, DEPLOYMENT)
        c = container(self.deployment)
        self.assertEqual(c["command"], ["/bin/ratelimit"])
        self.assertNotIn("args", c)
        self.assertEqual([e["name"] for e in c["env"]], EG_ENV)
        env = {e["name"]: e["value"] for e in c["env"]}
        self.assertEqual(env["CONFIG_TYPE"], "GRPC_XDS_SOTW")
        self.assertEqual(env["CONFIG_GRPC_XDS_NODE_ID"], "envoy-ratelimit")
        self.assertEqual(env["PROMETHEUS_ADDR"], ":19001")
        self.assertEqual({p["name"]: p["containerPort"] for p in c["ports"]}, {"grpc": 8081, "metrics": 19001})
        for probe, (period, failures) in {"startupProbe": (10, 30), "readinessProbe": (5, 1),
                                          "livenessProbe": (10, 3)}.items():
            self.assertEqual(c[probe]["httpGet"], {"path": "/healthcheck", "port": 8080, "scheme": "HTTP"})
            self.assertEqual((c[probe]["periodSeconds"], c[probe]["failureThreshold"]), (period, failures))
        sc = c["securityContext"]
        self.assertEqual((sc["runAsUser"], sc["runAsGroup"], sc["readOnlyRootFilesystem"]), (65534, 65534, True))
        self.assertEqual(sc["capabilities"], {"drop": ["ALL"]})
        self.assertEqual({m["mountPath"] for m in c["volumeMounts"]}, {"/certs", "/etc/statsd-exporter"})
        annotations = self.deployment["spec"]["template"]["metadata"]["annotations"]
        self.assertEqual(annotations["prometheus.io/port"], "19001")

    def test_the_image_has_bin_ratelimit_and_runs_as_nobody(self):
        with open(os.path.join(ROOT, "deploy", "Dockerfile")) as f:
            dockerfile = f.read()
        self.assertRegex(dockerfile, r"(?m)^RUN ln -s /usr/local/bin/sluice /bin/ratelimit$")
        self.assertRegex(dockerfile, r"(?m)^USER 65534:65534$")
        self.assertNotRegex(dockerfile, r"(?m)^ENV SLUICE_POLICIES", "would override RUNTIME_*")


if __name__ == "__main__":
    unittest.main()
