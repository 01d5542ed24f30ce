"""Interop: TLS on the gRPC port with Envoy's generated client (PyPI xds-protos + grpcio).

Starts the sluice binary named by $SLUICE with TLS settings (certificates made here by the
`openssl` command, in a temp dir laid out like a Kubernetes Secret volume: `tls.crt` and
`tls.key` are symlinks through `..data`) and checks: a call over TLS succeeds; with mTLS a client
without a certificate is refused, one with a certificate from the CA succeeds, and one whose
certificate lacks the required SAN is refused; a certificate rotated on disk (the `..data` swap
cert-manager and the kubelet do) is served to new connections without a restart, while a pair
that does not load leaves the served one in place.

Without openssl the tests skip with a notice, except on CI (env CI set), where they fail.

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_tls.py -v
"""

import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import unittest

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

POLICY = """
domain: tls
descriptors:
  - key: free
    rate_limit: {unlimited: true}
"""

if shutil.which("openssl") is None:
    if os.environ.get("CI"):
        raise RuntimeError("openssl is required on CI (Debian: apt-get install openssl)")
    print("test_tls: skipped: openssl is not installed (Debian: apt-get install openssl)")


def openssl(cwd, *args):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d):
    openssl(d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=sluice interop CA")


def make_cert(d, name, cn, san, usage):
    """`name`.crt and `name`.key signed by the CA in `d`."""
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
    openssl(d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
    openssl(d, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")


def read(d, name):
    with open(os.path.join(d, name), "rb") as f:
        return f.read()


class SecretVolume:
    """A directory shaped like a mounted Kubernetes Secret: `tls.crt` and `tls.key` point
    through the `..data` symlink at a versioned directory, swapped atomically on update."""

    def __init__(self, root):
        self.root = root
        self.version = 0
        for name in ("tls.crt", "tls.key"):
            os.symlink(os.path.join("..data", name), os.path.join(root, name))

    def publish(self, cert, key):
        self.version += 1
        v = f"..v{self.version}"
        os.mkdir(os.path.join(self.root, v))
        for name, data in (("tls.crt", cert), ("tls.key", key)):
            with open(os.path.join(self.root, v, name), "wb") as f:
                f.write(data)
        tmp = os.path.join(self.root, "..data_tmp")
        os.symlink(v, tmp)
        os.replace(tmp, os.path.join(self.root, "..data"))


class Server:
    """A sluice process with TLS on its gRPC port (settings as SLUICE_* variables)."""

    def __init__(self, env):
        self.dir = tempfile.TemporaryDirectory()
        with open(os.path.join(self.dir.name, "tls.yaml"), "w") as f:
            f.write(POLICY)
        self.proc = subprocess.Popen(
            [os.environ.get("SLUICE", "target/debug/sluice"), "serve",
             "--policies", self.dir.name, "--grpc-addr", "127.0.0.1:0",
             "--admin-addr", "127.0.0.1:0", "--log-format", "json"],
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, "RUST_LOG": "info", **env})
        deadline = time.time() + 30
        self.grpc = None
        while self.grpc is None:
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("sluice did not start: " + self.proc.stderr.read())
            try:
                event = json.loads(self.proc.stderr.readline())
            except ValueError:
                continue
            if event.get("message") == "serving":
                self.grpc = event["grpc"]
        self.port = int(self.grpc.rsplit(":", 1)[1])

    def call(self, ca, cert=None, key=None):
        """One ShouldRateLimit over TLS; the response, or raises grpc.RpcError."""
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                             certificate_chain=cert)
        channel = grpc.secure_channel(self.grpc, creds,
                                      options=[("grpc.ssl_target_name_override", "localhost")])
        try:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            d = ratelimit_pb2.RateLimitDescriptor(
                entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key="free", value="x")])
            return stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain="tls", descriptors=[d]),
                                        timeout=5)
        finally:
            channel.close()

    def peer_certificate(self, ca_file):
        """The certificate a new connection is served (verified against `ca_file`)."""
        ctx = ssl.create_default_context(cafile=ca_file)
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            with ctx.wrap_socket(sock, server_hostname="localhost") as tls:
                self.alpn = tls.selected_alpn_protocol()
                return tls.getpeercert()

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=15)
        self.proc.stderr.close()
        self.dir.cleanup()


def common_name(cert):
    return dict(x[0] for x in cert["subject"])["commonName"]


@unittest.skipIf(shutil.which("openssl") is None, "openssl is not installed")
class Tls(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name
        make_ca(self.d)
        make_cert(self.d, "a", "sluice-a", "DNS:localhost,IP:127.0.0.1", "serverAuth")
        self.ca = read(self.d, "ca.crt")
        self.vol = os.path.join(self.d, "secret")
        os.mkdir(self.vol)
        self.secret = SecretVolume(self.vol)
        self.secret.publish(read(self.d, "a.crt"), read(self.d, "a.key"))
        self.env = {"SLUICE_GRPC__TLS__CERT_FILE": os.path.join(self.vol, "tls.crt"),
                    "SLUICE_GRPC__TLS__KEY_FILE": os.path.join(self.vol, "tls.key")}

    def tearDown(self):
        self.tmp.cleanup()

    def test_a_call_over_tls_succeeds(self):
        s = Server(self.env)
        try:
            r = s.call(self.ca)
            self.assertEqual(r.overall_code, rls_pb2.RateLimitResponse.Code.OK)
            self.assertEqual(common_name(s.peer_certificate(os.path.join(self.d, "ca.crt"))),
                             "sluice-a")
            self.assertEqual(s.alpn, "h2")
            # A plaintext client is not served.
            channel = grpc.insecure_channel(s.grpc)
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            with self.assertRaises(grpc.RpcError) as e:
                stub.ShouldRateLimit(rls_pb2.RateLimitRequest(domain="tls"), timeout=3)
            self.assertIn(e.exception.code(),
                          (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED))
            channel.close()
        finally:
            s.close()

    def test_mtls_refuses_a_client_without_a_valid_certificate(self):
        make_cert(self.d, "envoy", "envoy", "DNS:envoy.test", "clientAuth")
        make_cert(self.d, "other", "other", "DNS:other.test", "clientAuth")
        s = Server({**self.env,
                    "SLUICE_GRPC__TLS__CLIENT_CA_FILE": os.path.join(self.d, "ca.crt"),
                    "SLUICE_GRPC__TLS__CLIENT_SAN": "envoy.test"})
        try:
            with self.assertRaises(grpc.RpcError) as e:
                s.call(self.ca)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
            r = s.call(self.ca, read(self.d, "envoy.crt"), read(self.d, "envoy.key"))
            self.assertEqual(r.overall_code, rls_pb2.RateLimitResponse.Code.OK)
            # From the right CA, but without the required SAN.
            with self.assertRaises(grpc.RpcError) as e:
                s.call(self.ca, read(self.d, "other.crt"), read(self.d, "other.key"))
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE)
        finally:
            s.close()

    def test_a_rotated_certificate_is_served_without_a_restart(self):
        ca_file = os.path.join(self.d, "ca.crt")
        s = Server(self.env)
        try:
            first = s.peer_certificate(ca_file)
            self.assertEqual(common_name(first), "sluice-a")
            make_cert(self.d, "b", "sluice-b", "DNS:localhost,IP:127.0.0.1", "serverAuth")
            self.secret.publish(read(self.d, "b.crt"), read(self.d, "b.key"))
            deadline = time.time() + 15
            served = first
            while common_name(served) != "sluice-b" and time.time() < deadline:
                time.sleep(0.2)
                served = s.peer_certificate(ca_file)
            self.assertEqual(common_name(served), "sluice-b")
            self.assertNotEqual(served["serialNumber"], first["serialNumber"])
            self.assertEqual(s.call(self.ca).overall_code, rls_pb2.RateLimitResponse.Code.OK)
            # A pair that does not belong together is not loaded: b stays in service.
            self.secret.publish(read(self.d, "a.crt"), read(self.d, "b.key"))
            time.sleep(5)
            self.assertEqual(common_name(s.peer_certificate(ca_file)), "sluice-b")
            self.assertEqual(s.call(self.ca).overall_code, rls_pb2.RateLimitResponse.Code.OK)
            self.assertIsNone(s.proc.poll(), "the server stopped")
        finally:
            s.close()

    def test_a_bad_certificate_at_start_is_an_error_naming_the_setting(self):
        with open(os.path.join(self.d, "junk.pem"), "w") as f:
            f.write("not a certificate\n")
        env = {**self.env, "SLUICE_GRPC__TLS__CERT_FILE": os.path.join(self.d, "junk.pem")}
        policies = os.path.join(self.d, "policies")
        os.mkdir(policies)
        with open(os.path.join(policies, "tls.yaml"), "w") as f:
            f.write(POLICY)
        out = subprocess.run(
            [os.environ.get("SLUICE", "target/debug/sluice"), "serve", "--policies", policies,
             "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("grpc.tls.cert_file", out.stderr)
        self.assertIn("junk.pem", out.stderr)
        self.assertIn("no PEM certificate", out.stderr)


if __name__ == "__main__":
    unittest.main()
