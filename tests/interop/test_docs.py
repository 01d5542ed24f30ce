"""The book's call with Envoy's own client, run as a reader would run it.

Takes the Python program of the `python3 -m venv` block of docs/src/get-started/index.md (the
README shows the same block), starts `sluice serve --config config/sluice.yaml` as the quick
start does, on free ports, checks that the README shows the same program, runs it against it with this venv's Python, and checks
that the answer holds, in order, every limit and remaining count of the `text` block the page
shows after it.

Run: SLUICE=target/debug/sluice python3 -m unittest tests/interop/test_docs.py -v
"""

import os
import re
import subprocess
import sys
import unittest
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs/src/get-started/index.md"


def fenced_blocks(text):
    """(language, body) of each fenced block of a Markdown text."""
    return re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M)


class EnvoyClientExample(unittest.TestCase):
    def setUp(self):
        self.grpc, self.admin = free_port(), free_port()
        self.proc = subprocess.Popen(
            [os.environ.get("SLUICE", "target/debug/sluice"), "serve", "--config",
             "config/sluice.yaml", "--grpc-addr", f"127.0.0.1:{self.grpc}",
             "--admin-addr", f"127.0.0.1:{self.admin}"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_healthy(f"127.0.0.1:{self.admin}")

    def tearDown(self):
        self.proc.terminate()
        self.proc.wait(timeout=15)

    def test_the_pages_program_prints_the_answer_the_page_shows(self):
        blocks = fenced_blocks(PAGE.read_text())
        (at,) = [i for i, (lang, body) in enumerate(blocks)
                 if lang == "sh" and body.startswith("python3 -m venv")]
        self.assertIn(blocks[at][1], (ROOT / "README.md").read_text(),
                      "the README shows the same program")
        program = re.search(r"<<'PY'\n(.*?)^PY$", blocks[at][1], re.S | re.M).group(1)
        lang, shown = blocks[at + 1]
        self.assertEqual(lang, "text", "the answer follows the program")
        program = program.replace("127.0.0.1:8081", f"127.0.0.1:{self.grpc}")
        out = subprocess.run([sys.executable, "-"], input=program, capture_output=True,
                             text=True, timeout=30, check=True).stdout
        flat = " ".join(out.split())
        # What the page shows, field by field, in order: the overall code, then each status's
        # code, limit and remaining count.
        expected = re.findall(
            r"overall_code: \w+|code: \w+|requests_per_unit: \d+|unit: \w+|name: \"[^\"]+\""
            r"|limit_remaining: \d+|seconds: \d+", shown)
        self.assertGreater(len(expected), 5)
        position = 0
        for field in expected:
            found = flat.find(field, position)
            self.assertNotEqual(found, -1, f"{field!r} not in the answer after position "
                                           f"{position}:\n{out}")
            position = found + len(field)


if __name__ == "__main__":
    unittest.main()
