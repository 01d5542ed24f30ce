#!/usr/bin/env python3
"""How right `GET /limited` is about who is being limited, and what it costs in memory.

A Zipf mix (s = 1.1) over 100,000 keys (`user=z<k>`), sent by this script with 64 calls in
flight, each answer read, so that it counts every key's true hits and refusals itself; and one
attacker, `loadgen`, rotating keys (`user=u<k>` drawn from 10,000,000) at 10,000 calls a second.
The rule allows 5 a second per key. After `--seconds` (at most 25, so the run fits the
sketch's window of 30 to 60 s) it reads `/limited` and compares its top 10 refused and top 10
hit keys with the true ones: the overlap, and the largest error of a reported count against the
stated bound (N / capacity). The server's VmRSS and the sketch slots held (at most 4 × capacity
per rule) are read before the load, after it, and after a second run of the same length on new
attacker keys, a minute later (the first run's counts have then left the window).

    cargo build --example loadgen
    target/interop-venv/bin/python benches/load/hitters.py --bin target/debug/sluice \
        --loadgen target/debug/examples/loadgen
"""

import argparse
import bisect
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tests" / "interop"))
from common import Sluice  # noqa: E402

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2  # noqa: E402
from envoy.service.ratelimit.v3 import rls_pb2  # noqa: E402

POLICY = """
domain: acc
descriptors:
  - key: user
    rate_limit: {name: per-user, unit: second, requests_per_unit: 5}
"""
KEYS, S, TOP, IN_FLIGHT = 100_000, 1.1, 10, 64
D = ratelimit_pb2.RateLimitDescriptor


def rss_mib(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    kb = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    return kb / 1024


def limited(admin):
    with urllib.request.urlopen(f"http://{admin}/limited", timeout=30) as r:
        return json.loads(r.read())


def zipf_sampler(rng):
    cumulative = list(itertools.accumulate(1 / (k ** S) for k in range(1, KEYS + 1)))
    total = cumulative[-1]
    return lambda: bisect.bisect_left(cumulative, rng.random() * total) + 1


def zipf_load(s, seconds, hits, refused):
    """Sends the Zipf mix for `seconds`, IN_FLIGHT calls at a time, counting each answer."""
    rng = random.Random(7)
    draw = zipf_sampler(rng)
    lock = threading.Lock()
    slots = threading.Semaphore(IN_FLIGHT)
    sent = [0]
    deadline = time.time() + seconds
    over = rls_pb2.RateLimitResponse.OVER_LIMIT

    def done(key, fut):
        try:
            code = fut.result().overall_code
        except Exception:  # noqa: BLE001  (an error is counted as neither)
            code = None
        with lock:
            if code is not None:
                hits[key] = hits.get(key, 0) + 1
                if code == over:
                    refused[key] = refused.get(key, 0) + 1
        slots.release()

    while time.time() < deadline:
        slots.acquire()
        key = f"z{draw()}"
        req = rls_pb2.RateLimitRequest(
            domain="acc", descriptors=[D(entries=[D.Entry(key="user", value=key)])])
        fut = s.stub.ShouldRateLimit.future(req, timeout=10)
        fut.add_done_callback(lambda f, k=key: done(k, f))
        sent[0] += 1
    for _ in range(IN_FLIGHT):
        slots.acquire()
    return sent[0]


def attacker(loadgen, grpc, seconds, offset):
    return subprocess.Popen(
        [loadgen, "--addr", grpc, "-c", "2", "-m", "16", "--rate", "10000", "--warm-up", "0",
         "--seconds", str(seconds), "--keys", "10000000", "--key-offset", str(offset),
         "--descriptors", "1", "--domain", "acc"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def compare(name, reported, truth, bound):
    """Overlap of the reported top with the true top, and the largest count error (Zipf keys:
    the only ones whose true counts this script knows)."""
    true_top = sorted(truth.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP]
    got = [(k["entries"][0]["value"], k["count"]) for k in reported[:TOP]]
    overlap = len({k for k, _ in true_top} & {k for k, _ in got})
    # A key outside the true top 10 is within the error when its true count is at least the
    # 10th true count less twice the bound.
    tenth = true_top[-1][1] if true_top else 0
    errors = [abs(c - truth.get(k, 0)) for k, c in got if k.startswith("z")]
    explained = all(truth.get(k, 0) >= tenth - 2 * bound for k, _ in got)
    print(f"{name}: overlap {overlap}/{TOP} with the true top {TOP}; "
          f"max count error {max(errors, default=0)} vs bound {bound}; "
          f"every reported key within the bound of the top: {explained}")
    print(f"  true:     {true_top}")
    print(f"  reported: {got}")
    return overlap, max(errors, default=0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/sluice")
    ap.add_argument("--loadgen", default="target/debug/examples/loadgen")
    ap.add_argument("--seconds", type=float, default=20)
    args = ap.parse_args()
    os.environ["SLUICE"] = args.bin
    with tempfile.TemporaryDirectory() as d:
        Path(d, "acc.yaml").write_text(POLICY)
        s = Sluice({
            "PATH": os.environ.get("PATH", ""),
            "SLUICE_GRPC_ADDR": "127.0.0.1:0", "SLUICE_ADMIN_ADDR": "127.0.0.1:0",
            "SLUICE_LOG_FORMAT": "json", "SLUICE_POLICIES": d,
        }, redis=False)
        try:
            pid = s.proc.pid
            before = (rss_mib(pid), limited(s.admin)["slots_held"])
            rows = []
            for run, offset in enumerate([0, 50_000_000]):
                hits, refused = {}, {}
                gen = attacker(args.loadgen, s.grpc, args.seconds, offset)
                sent = zipf_load(s, args.seconds, hits, refused)
                out, _ = gen.communicate(timeout=120)
                j = limited(s.admin)
                r = next(x for x in j["rules"] if x["rule"] == "acc.user")
                figures = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
                print(f"run {run + 1}: {args.seconds:.0f} s, zipf calls {sent} "
                      f"({sent / args.seconds:.0f}/s), attacker {figures.get('rate', '?')}/s; "
                      f"window {r['window']}, bound {r['error_bound']}")
                o_r, e_r = compare("refused", r["top_refused"], refused, r["error_bound"]["refused"])
                o_h, e_h = compare("hits", r["top_hits"], hits, r["error_bound"]["hits"])
                rows.append((rss_mib(pid), j["slots_held"]))
                if run == 0:
                    # Both halves of the window rotate out before the second run, so that its
                    # counts are its own.
                    time.sleep(61)
            print(f"RSS MiB / sketch slots: before {before[0]:.1f} / {before[1]}, "
                  + ", ".join(f"after run {i + 1} {m:.1f} / {n}" for i, (m, n) in enumerate(rows)))
        finally:
            s.close()


if __name__ == "__main__":
    main()
