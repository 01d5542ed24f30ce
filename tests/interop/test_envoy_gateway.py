"""Envoy Gateway's rate-limit Deployment on sluice (deploy/envoy-gateway/), with Envoy's generated
client (PyPI xds-protos + grpcio).

- envoy-gateway-config.yaml (the ConfigMap holding Envoy Gateway's `EnvoyGateway` config) parses
  strictly against the fields it may use, and swaps the rate-limit image to sluice.
- ratelimit-deployment.yaml parses strictly: the Deployment Envoy Gateway renders, its command
  `/bin/ratelimit`, every variable in Envoy Gateway's order, its mounts, ports, probes and
  security context; only the image differs. The image (deploy/Dockerfile) has `/bin/ratelimit`
  and runs as 65534.
- The binary, invoked as `ratelimit` through a symlink, with exactly that Deployment's
  environment except free ports, certificate paths pointed at certificates made here with
  `openssl` in Envoy Gateway's shape, and the policy source: `/healthcheck` on PORT, gRPC with
  TLS (and no plaintext), the over-limit series with the sanitised `key2` on PROMETHEUS_ADDR after
  an over-limit call, and `/rlconfig` on the debug port.

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_envoy_gateway.py -v
"""

import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc
import yaml
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Redis, free_port, have_redis, wait_healthy  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
HAVE_REDIS = have_redis("test_envoy_gateway")
HAVE_OPENSSL = shutil.which("openssl") is not None
if not HAVE_OPENSSL and os.environ.get("CI"):
    raise RuntimeError("openssl is required on CI (Debian: apt-get install openssl)")

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

# A route's limit as Envoy Gateway generates it: domain = listener, the route entry with
# key = value = route name, then the client CIDR.
DOMAIN = "default/eg/http"
ROUTE = "httproute/default/http-ratelimit/rule/0/match/0/ratelimit_example"
POLICY = f"""domain: {DOMAIN}
descriptors:
  - key: {ROUTE}
    value: {ROUTE}
    descriptors:
      - key: masked_remote_address
        value: 0.0.0.0/0
        rate_limit: {{requests_per_unit: 3, unit: Hour}}
"""

D = ratelimit_pb2.RateLimitDescriptor
Code = rls_pb2.RateLimitResponse.Code


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


def openssl(cwd, *args):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def envoy_gateway_certs(d):
    """The Secret Envoy Gateway mounts at /certs, in its shape (internal/crypto/certgen.go): an
    RSA CA; `tls.crt` with CN envoy and a DNS SAN `*.<namespace>`, no ExtendedKeyUsage; `tls.key`
    a PKCS#1 `RSA PRIVATE KEY`."""
    openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-subj", "/CN=envoy-gateway")
    openssl(d, "genrsa", "-traditional", "-out", "tls.key", "2048")
    openssl(d, "req", "-new", "-key", "tls.key", "-out", "tls.csr", "-subj", "/CN=envoy")
    with open(os.path.join(d, "tls.ext"), "w") as f:
        f.write("subjectAltName=DNS:*.envoy-gateway-system\nkeyUsage=digitalSignature,keyEncipherment\n")
    openssl(d, "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "2", "-extfile", "tls.ext")
    with open(os.path.join(d, "tls.key")) as f:
        assert f.readline().strip() == "-----BEGIN RSA PRIVATE KEY-----"


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@unittest.skipUnless(HAVE_REDIS and HAVE_OPENSSL, "redis-server or openssl is not installed")
class DeploymentEnvironment(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.redis = Redis()
        self.addCleanup(self.redis.close)
        (deployment,) = load("deploy", "envoy-gateway", "ratelimit-deployment.yaml")
        self.deployed = [(e["name"], e["value"]) for e in container(deployment)["env"]]
        certs = os.path.join(self.dir.name, "certs")
        os.mkdir(certs)
        envoy_gateway_certs(certs)
        self.ports = {name: free_port() for name in ("PORT", "GRPC_PORT", "DEBUG_PORT", "PROMETHEUS_ADDR")}
        env = {}
        for name, value in self.deployed:
            if value.startswith("/certs/"):
                value = os.path.join(certs, value[len("/certs/"):])
            elif name == "PROMETHEUS_ADDR":
                value = f":{self.ports[name]}"
            elif name == "REDIS_URL":
                value = f"127.0.0.1:{self.redis.port}"
            env[name] = value
        # Envoy Gateway sets no PORT, GRPC_PORT or DEBUG_PORT: the reference's 8080, 8081 and
        # 6070, moved to free ports here.
        for name in ("PORT", "GRPC_PORT", "DEBUG_PORT"):
            env[name] = str(self.ports[name])
        self.policy_source(env)
        self.env = env
        self.start()

    def policy_source(self, env):
        """Where the policies come from. The environment is the Deployment's but for this:
        CONFIG_TYPE=FILE and RUNTIME_ROOT a directory holding Envoy Gateway's descriptor tree,
        until a management server shaped like Envoy Gateway's serves it over xDS (then keep
        CONFIG_TYPE and point CONFIG_GRPC_XDS_SERVER_URL, and the certificates, at it)."""
        config = os.path.join(self.dir.name, "runtime", env["RUNTIME_SUBDIRECTORY"], "config")
        os.makedirs(config)
        with open(os.path.join(config, "envoy-gateway"), "w") as f:
            f.write(POLICY)
        env["CONFIG_TYPE"] = "FILE"
        env["RUNTIME_ROOT"] = os.path.join(self.dir.name, "runtime")

    def start(self):
        link = os.path.join(self.dir.name, "ratelimit")
        os.symlink(os.path.abspath(os.environ.get("SLUICE", os.path.join(ROOT, "target", "debug", "sluice"))), link)
        self.proc = subprocess.Popen([link], env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.log = []
        lines = queue.Queue()

        def drain():
            for line in self.proc.stderr:
                self.log.append(line)
                lines.put(line)
        self.drain = threading.Thread(target=drain, daemon=True)
        self.drain.start()
        self.addCleanup(self.stop)
        try:
            wait_healthy(f"127.0.0.1:{self.ports['PORT']}")
        except RuntimeError:
            raise RuntimeError(f"not healthy: {''.join(self.log)}") from None

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.drain.join(timeout=5)
        self.proc.stderr.close()

    def channel(self):
        with open(os.path.join(self.dir.name, "certs", "ca.crt"), "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        # Envoy reaches the Service envoy-ratelimit.envoy-gateway-system; the SAN is *.<namespace>.
        return grpc.secure_channel(f"127.0.0.1:{self.ports['GRPC_PORT']}", creds, options=[
            ("grpc.ssl_target_name_override", "envoy-ratelimit.envoy-gateway-system")])

    def call(self, stub):
        d = D(entries=[D.Entry(key=ROUTE, value=ROUTE),
                       D.Entry(key="masked_remote_address", value="0.0.0.0/0")])
        req = rls_pb2.RateLimitRequest(domain=DOMAIN, descriptors=[d])
        deadline = time.time() + 15
        while True:
            try:
                return stub.ShouldRateLimit(req, timeout=5)
            except grpc.RpcError as e:
                # The first call also loads the Lua script, which a busy machine can take longer for.
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.time() > deadline:
                    raise

    def test_serves_what_envoy_gateway_probes_calls_and_scrapes(self):
        # Exactly the Deployment's variables but the ports, certificate paths and policy source.
        changed = {k for k, v in self.deployed if self.env[k] != v}
        self.assertEqual(changed, {"GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY", "GRPC_SERVER_TLS_CA_CERT",
                                   "CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
                                   "CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "PROMETHEUS_ADDR", "REDIS_URL",
                                   "CONFIG_TYPE", "RUNTIME_ROOT"})
        self.assertEqual(set(self.env) - {k for k, _ in self.deployed}, {"PORT", "GRPC_PORT", "DEBUG_PORT"})
        # The probes' /healthcheck on PORT.
        self.assertEqual(get(f"http://127.0.0.1:{self.ports['PORT']}/healthcheck"), (200, "OK"))
        # gRPC over TLS, as Envoy calls it: 3 per hour, then over the limit.
        stub = rls_pb2_grpc.RateLimitServiceStub(self.channel())
        codes = [self.call(stub).overall_code for _ in range(4)]
        self.assertEqual(codes, [Code.OK, Code.OK, Code.OK, Code.OVER_LIMIT])
        # No plaintext on the TLS port.
        with self.assertRaises(grpc.RpcError):
            plain = rls_pb2_grpc.RateLimitServiceStub(grpc.insecure_channel(f"127.0.0.1:{self.ports['GRPC_PORT']}"))
            plain.ShouldRateLimit(rls_pb2.RateLimitRequest(domain=DOMAIN), timeout=3)
        # Prometheus on PROMETHEUS_ADDR: the series Envoy Gateway's e2e reads, key2 sanitised.
        status, metrics = get(f"http://127.0.0.1:{self.ports['PROMETHEUS_ADDR']}/metrics")
        self.assertEqual(status, 200)
        series = (f'ratelimit_service_rate_limit_over_limit{{domain="{DOMAIN}",key1="{ROUTE}_{ROUTE}",'
                  f'key2="masked_remote_address_0_0_0_0/0"}} (\\d+)')
        found = re.search(series, metrics)
        self.assertIsNotNone(found, metrics)
        self.assertEqual(int(found.group(1)), 1)
        self.assertRegex(metrics, r'ratelimit_service_total_requests\{grpc_method="ShouldRateLimit"\} [1-9]')
        # /rlconfig on the debug port, where `egctl config envoy-ratelimit` reads it.
        status, rlconfig = get(f"http://127.0.0.1:{self.ports['DEBUG_PORT']}/rlconfig")
        self.assertEqual(status, 200)
        self.assertIn(f"{DOMAIN}.{ROUTE}_{ROUTE}.masked_remote_address_0.0.0.0/0: unit=HOUR", rlconfig)
        # The log says how it was started and what of the environment is not acted on.
        log = "".join(self.log)
        self.assertIn("invoked as ratelimit", log)
        self.assertIn("GRPC_SERVER_TLS_CA_CERT", log)
        self.assertIn(f"metrics 0.0.0.0:{self.ports['PROMETHEUS_ADDR']} (/metrics)", log)


if __name__ == "__main__":
    unittest.main()
