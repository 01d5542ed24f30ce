"""Interop: the live page of who is being limited (`GET /limited/page`) in a real browser.

`sluice serve` (memory backend) takes load from `loadgen` (50 users at 10 calls a second each,
over a limit of 5 a second) while this test hammers two more users: `mallory`, the heaviest,
and one whose value is markup, `<img src=x onerror=alert(1)>`. Debian's `chromium` loads the
page headless and dumps its DOM once the page has polled `/limited`: the rule and `mallory` as
the top refused key are shown, and the hostile value is text (escaped in the dump), never an
element. With LIMITED_PNG set, a 1200x800 screenshot of the page is written there (the book's
docs/src/operate/limited.png).

Skipped with a notice without chromium or the loadgen example, except on CI (env CI set), where
both are required.

Run: cargo build --example loadgen && SLUICE=target/debug/sluice \
     python3 -m unittest tests/interop/test_page.py -v
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Sluice  # noqa: E402

POLICY = """
domain: bench
descriptors:
  - key: user
    rate_limit: {name: per-user, unit: second, requests_per_unit: 5}
"""
HOSTILE = "<img src=x onerror=alert(1)>"
LOADGEN = os.environ.get("LOADGEN", "target/debug/examples/loadgen")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def required(what, present, hint):
    if present:
        return True
    if os.environ.get("CI"):
        raise RuntimeError(f"{what} is required on CI ({hint})")
    print(f"test_page: skipped: {what} is missing ({hint})")
    return False


HAVE_ALL = (required("chromium", CHROMIUM, "Debian: apt-get install chromium")
            and required(LOADGEN, os.path.exists(LOADGEN), "cargo build --example loadgen"))

D = ratelimit_pb2.RateLimitDescriptor


def user(value):
    return rls_pb2.RateLimitRequest(
        domain="bench", descriptors=[D(entries=[D.Entry(key="user", value=value)])])


def chromium(*args):
    out = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--hide-scrollbars", *args],
        capture_output=True, text=True, timeout=120)
    return out.stdout


@unittest.skipUnless(HAVE_ALL, "chromium or loadgen is missing")
class LivePage(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        with open(os.path.join(self.dir.name, "bench.yaml"), "w") as f:
            f.write(POLICY)
        self.s = Sluice({
            "PATH": os.environ.get("PATH", ""),
            "SLUICE_GRPC_ADDR": "127.0.0.1:0", "SLUICE_ADMIN_ADDR": "127.0.0.1:0",
            "SLUICE_LOG_FORMAT": "json", "SLUICE_POLICIES": self.dir.name,
        }, redis=False)
        self.addCleanup(self.s.close)

    def load(self, seconds):
        """loadgen on 50 users at 500 calls a second, and this test's two users, for `seconds`."""
        gen = subprocess.Popen(
            [LOADGEN, "--addr", self.s.grpc, "-c", "2", "-m", "4", "--rate", "500",
             "--warm-up", "0", "--seconds", str(seconds), "--keys", "50",
             "--descriptors", "1", "--domain", "bench"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(gen.communicate, timeout=60)
        self.addCleanup(gen.kill)

        def hammer():
            for i in range(900):
                self.s.call(user("mallory"))
                if i % 3 == 0:
                    self.s.call(user(HOSTILE))
        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        return t

    def test_the_page_shows_the_rule_and_the_top_refused_key_and_values_as_text(self):
        url = f"http://{self.s.admin}/limited/page"
        self.load(8).join(timeout=60)
        dom = chromium("--dump-dom", "--virtual-time-budget=4000", url)
        self.assertIn("bench / bench.user", dom, dom[:2000])
        self.assertIn("(per-user)", dom)
        # The first key of the "Top refused keys" table is mallory's.
        top = dom.split("Top refused keys", 1)[1]
        first = re.search(r'<td class="key">(.*?)</td>', top)
        self.assertIsNotNone(first, top[:2000])
        self.assertEqual(first.group(1), "user=mallory")
        # The hostile value is text: escaped in the dump, and no img element exists.
        self.assertIn("user=&lt;img src=x onerror=alert(1)&gt;", dom)
        self.assertNotIn("<img", dom)
        self.assertIsNone(re.search(r"<[^>]*\bonerror\s*=", dom))
        self.assertRegex(dom, r"policy version 1 · reloads 0")
        png = os.environ.get("LIMITED_PNG")
        if png:
            # Polled while load runs, so the chart has rates to draw.
            loading = self.load(10)
            chromium(f"--screenshot={os.path.abspath(png)}", "--window-size=1200,800",
                     "--virtual-time-budget=9000", url)
            loading.join(timeout=60)
            with open(png, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


if __name__ == "__main__":
    unittest.main()
