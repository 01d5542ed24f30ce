#!/usr/bin/env python3
"""The overload trial of shared counters, from outside: sluice nodes on one Redis, one rule of
200 a second with a burst of 200, each node offered a fixed rate in bursts of 50 ms for a
number of seconds, every answer's time and code recorded by a gRPC client (Envoy's generated
stubs, as tests/interop uses).

Prints per node the decisions, the Redis round trips (by purpose) per second and per decision;
for the fleet the admitted count against R x span and the largest count in any window of 50 ms,
250 ms, 1 s and 3 s against the stated bound B + floor((W + L) / T). `--exact` runs the same
trial with leases off (one round trip per decision, the exact bound). Exits 1 when a window
passes its bound or a call fails.

    target/interop-venv/bin/python benches/load/shares.py --bin target/release/sluice
"""

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

RATE, BURST = 200, 200
T = 1.0 / RATE
POLICY = f"""domain: trial
descriptors:
  - key: k
    rate_limit: {{unit: second, requests_per_unit: {RATE}, burst: {BURST}}}
"""
WINDOWS = (0.05, 0.25, 1.0, 3.0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(admin):
    body = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read().decode()
    out = {}
    for line in body.splitlines():
        m = re.match(r'^(sluice_redis_round_trips_total|sluice_redis_round_trips_by_purpose_total'
                     r'\{purpose="\w+"\}|sluice_decisions_total\{result="\w+"\}|sluice_lease_shares'
                     r'|sluice_lease_share_renewals_total|sluice_lease_slices_total)\s+(\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def start_node(binary, policies, redis_port, exact, lease_ms, work, i):
    grpc_port, admin = free_port(), free_port()
    env = {"SLUICE_BACKEND": "redis", "SLUICE_REDIS__URL": f"redis://127.0.0.1:{redis_port}",
           "SLUICE_REDIS__LEASE__ENABLED": "false" if exact else "true",
           "SLUICE_REDIS__LEASE__MAX_AGE_MS": str(lease_ms),
           "SLUICE_REDIS__LEASE__MAX_BURST_SHARE": "0.25",
           "SLUICE_REDIS__LEASE__MIN_RATE": "5", "PATH": "/usr/bin:/bin"}
    log = open(Path(work, f"node{i}.log"), "w")
    proc = subprocess.Popen([binary, "serve", "--policies", str(policies),
                             "--grpc-addr", f"127.0.0.1:{grpc_port}",
                             "--admin-addr", f"127.0.0.1:{admin}", "--log-level", "warn"],
                            env=env, stdout=log, stderr=log)
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{admin}/healthcheck", timeout=1)
            return proc, grpc_port, admin
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"shares: node {i} exited with {proc.returncode}")
            time.sleep(0.1)
    sys.exit(f"shares: node {i} did not start")


def drive(port, rate, seconds, start, answers):
    """`rate` calls a second in bursts every 50 ms from `start`, each answer's time and code
    appended to `answers`."""
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = rls_pb2_grpc.RateLimitServiceStub(channel)
    request = rls_pb2.RateLimitRequest(domain="trial", descriptors=[
        ratelimit_pb2.RateLimitDescriptor(entries=[
            ratelimit_pb2.RateLimitDescriptor.Entry(key="k", value="v")])])
    per_burst = rate / 20.0
    owed, pending = 0.0, []
    lock = threading.Lock()
    errors = [0]

    def done(fut):
        at = time.monotonic()
        try:
            code = fut.result().overall_code
        except grpc.RpcError as e:
            with lock:
                errors[0] += 1
                if errors[0] == 1:
                    print(f"  !! a call failed: {e.code()} {e.details()}", flush=True)
            return
        with lock:
            answers.append((at, code == rls_pb2.RateLimitResponse.OK))

    for k in range(int(seconds * 20)):
        wake = start + k * 0.05
        delay = wake - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        owed += per_burst
        n, owed = int(owed), owed - int(owed)
        for _ in range(n):
            fut = stub.ShouldRateLimit.future(request, timeout=5)
            fut.add_done_callback(done)
            pending.append(fut)
    for fut in pending:
        try:
            fut.result()
        except grpc.RpcError:
            pass
    channel.close()
    return errors[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="the sluice binary")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rate", type=float, nargs="+", default=[900.0],
                    help="calls a second offered to each node (one value, or one per node)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--lease-max-age-ms", type=int, default=500, help="L")
    ap.add_argument("--exact", action="store_true", help="leases off: every decision in Redis")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    rates = args.rate * args.nodes if len(args.rate) == 1 else args.rate
    if len(rates) != args.nodes:
        sys.exit("shares: give one --rate, or one per node")
    L = args.lease_max_age_ms / 1000
    work = tempfile.mkdtemp(prefix="sluice-shares-")
    policies = Path(work, "policies")
    policies.mkdir()
    Path(policies, "trial.yaml").write_text(POLICY)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", work],
                             stdout=subprocess.DEVNULL)
    nodes = []
    try:
        time.sleep(0.5)
        nodes = [start_node(args.bin, policies, redis_port, args.exact, args.lease_max_age_ms,
                            work, i) for i in range(args.nodes)]
        mode = "exact (leases off)" if args.exact else f"leased, L = {L:g} s"
        print(f"== {args.nodes} nodes on one Redis, {mode}; rule {RATE}/s, burst {BURST};"
              f" offered {', '.join(f'{r:g}' for r in rates)} calls/s for {args.seconds:g} s",
              flush=True)
        before = [metrics(admin) for _, _, admin in nodes]
        answers = [[] for _ in nodes]
        errors = [0] * len(nodes)
        start = time.monotonic() + 0.2

        def run(i):
            errors[i] = drive(nodes[i][1], rates[i], args.seconds, start, answers[i])
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        after = [metrics(admin) for _, _, admin in nodes]
    finally:
        for proc, _, _ in nodes:
            proc.terminate()
            proc.wait(timeout=30)
        redis.terminate()
        redis.wait()

    failed = False
    figures = {"nodes": [], "mode": "exact" if args.exact else "leased", "L": L,
               "offered": rates, "seconds": args.seconds}
    all_answers = sorted(a for node in answers for a in node)
    first, last = all_answers[0][0], all_answers[-1][0]
    span = last - first
    for i, (b, a) in enumerate(zip(before, after)):
        d = {k: a.get(k, 0) - b.get(k, 0) for k in a}
        decisions = len(answers[i])
        ok = sum(1 for _, admitted in answers[i] if admitted)
        trips = d.get("sluice_redis_round_trips_total", 0)
        purposes = {p: int(d.get(f'sluice_redis_round_trips_by_purpose_total{{purpose="{p}"}}', 0))
                    for p in ("count", "take", "give", "renew")}
        row = {"decisions": decisions, "admitted": ok, "admitted_fraction": ok / max(decisions, 1),
               "round_trips": int(trips), "trips_per_second": trips / span,
               "trips_per_decision": trips / max(decisions, 1), "by_purpose": purposes,
               "errors": errors[i], "shares_held": a.get("sluice_lease_shares", 0)}
        figures["nodes"].append(row)
        print(f"node {i + 1}: {decisions:,} decisions, {ok:,} admitted ({row['admitted_fraction']:.1%});"
              f" {int(trips):,} round trips = {row['trips_per_second']:.1f}/s ="
              f" {row['trips_per_decision']:.4f} per decision"
              f" (count {purposes['count']}, take {purposes['take']}, give {purposes['give']},"
              f" renew {purposes['renew']}); shares held at the end {row['shares_held']:g}")
        if errors[i]:
            print(f"  !! {errors[i]} calls failed")
            failed = True
    admitted = [at for at, ok in all_answers if ok]
    total = len(admitted)
    figures.update(admitted=total, span=span, r_span=RATE * span)
    print(f"fleet: {total:,} admitted in {span:.2f} s = {total / (RATE * span):.1%} of R x span"
          f" ({RATE * span:,.0f})")
    extra = 0 if args.exact else L
    figures["windows"] = {}
    for w in WINDOWS:
        most, j = 0, 0
        for i in range(len(admitted)):
            while j < len(admitted) and admitted[j] <= admitted[i] + w:
                j += 1
            most = max(most, j - i)
        bound = BURST + int((w + extra) / T + 1e-9)
        figures["windows"][str(w)] = {"most": most, "bound": bound}
        flag = "" if most <= bound else "  !! over the bound"
        print(f"  any {w * 1000:g} ms: at most {most} admitted (bound {bound}){flag}")
        failed |= most > bound
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
