#!/usr/bin/env python3
"""Instructions per ShouldRateLimit call, counted by callgrind: a machine-independent figure that
other load on the machine does not move. Runs each given server build under
`valgrind --tool=callgrind`, zeroes the counters once it is healthy, drives it with h2load (a fixed
count of hot-key calls) and with loadgen (two descriptors over 100,000 keys, for a fixed time),
dumps, and divides the instructions by the decisions the server itself counted (by the calls the
driver saw answered for the floor example, which decides nothing and counts no decision).

    python3 benches/load/instructions.py --loadgen LOADGEN NAME=BIN [NAME=BIN ...]

--leased compares, for each build, a node counting in memory with one leasing from a Redis the
script starts (redis-server on a free loopback port), on a counter offered far above its rate
(100 a second, burst 1,000, at the few thousand calls a second a server runs at under callgrind):
instructions per decision, and who answered.

    python3 benches/load/instructions.py --loadgen LOADGEN --leased NAME=BIN

--traced compares, for each build, tracing off with tracing on at ratio 1 and at 0.01, the spans
exported over OTLP/gRPC to a receiver the script serves (it needs grpcio and
opentelemetry-proto, e.g. in tests/interop's virtualenv), on the hot key.

    python3 benches/load/instructions.py --loadgen LOADGEN --traced NAME=BIN

--hitters compares, for each build, the heaviest keys of each rule not tracked
(`metrics.top_keys: 0`) with tracked (the default, 10), on the hot key and on two descriptors over
100,000 keys, both driven by loadgen paced to `--rate` for `--seconds` (no h2load needed).

    python3 benches/load/instructions.py --loadgen LOADGEN --hitters NAME=BIN

--quota counts instructions per RLQS bucket report instead: rlqsgen (--rlqsgen) opens
--streams streams, 100 to a connection, each reporting 10 buckets a second to one rule of
10,000 a second, shared by every stream and then distinct (each stream's buckets its own), as
quota.py does at 10,000 streams; the count starts after --warm-up seconds and runs for
--seconds, and is divided by the reports the server counted over the same span.

    python3 benches/load/instructions.py --quota --rlqsgen RLQSGEN NAME=BIN
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
import callgrind  # noqa: E402  (reading the dumps, shared with benches/redis)
import run  # noqa: E402  (the load benchmark's helpers)


def decisions(m):
    """The decisions in a scrape of the server's counters."""
    return sum(m.get(k, 0) for k in ("ok", "over_limit", "invalid", "backend_error"))


def under_callgrind(binary, policies, work, extra=(), env=None):
    """`binary` serving `policies` under callgrind (dumps to `work`/callgrind.out), once healthy:
    the process and its gRPC and admin ports."""
    out = Path(work, "callgrind.out")
    grpc, admin = run.free_port(), run.free_port()
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", binary, "serve",
         "--policies", str(policies), "--grpc-addr", f"127.0.0.1:{grpc}",
         "--admin-addr", f"127.0.0.1:{admin}", "--log-level", "error", *extra],
        stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{admin}/healthcheck", timeout=1)
            return proc, grpc, admin
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    sys.exit("instructions: the server did not start under valgrind")


def measure(binary, policies, drive, work, extra=(), env=None, warm=None, figures=None):
    """Instructions per decision and the decisions counted; `warm(server)` runs before the
    counters are zeroed, and `figures`, when given, receives the server's counters' deltas."""
    proc, grpc, admin = under_callgrind(binary, policies, work, extra, env)
    try:
        server = type("S", (), {"grpc": grpc, "admin": admin})
        if warm:
            warm(server)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        first = run.metrics(admin)
        answered = drive(server)
        last = run.metrics(admin)
        before, after = decisions(first), decisions(last)
        if figures is not None:
            figures.update({k: last.get(k, 0) - first.get(k, 0) for k in last})
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    total = callgrind.total(work, "callgrind.out")
    for p in Path(work).glob("callgrind.out*"):
        p.unlink()
    calls = after - before or answered
    if not calls:
        sys.exit("instructions: no call was answered")
    return total / calls, calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loadgen", help="the loadgen example's binary (all but --quota)")
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--leased", action="store_true",
                    help="memory against leased counting on a counter offered above its rate")
    ap.add_argument("--traced", action="store_true",
                    help="tracing off against tracing on at ratio 1 and 0.01, on the hot key")
    ap.add_argument("--hitters", action="store_true",
                    help="the top keys not tracked against tracked, hot key and 100k keys")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rate", type=int, default=80,
                    help="--hitters: calls a second, below what the server does under callgrind, so "
                         "that both settings answer the same calls and share out the same background")
    ap.add_argument("--quota", action="store_true",
                    help="instructions per RLQS bucket report, shared and distinct buckets")
    ap.add_argument("--rlqsgen", help="--quota: the rlqsgen example's binary")
    ap.add_argument("--streams", type=int, default=200, help="--quota: streams opened")
    ap.add_argument("--warm-up", type=float, default=15, help="--quota: seconds before counting")
    ap.add_argument("builds", nargs="+", metavar="NAME=BIN")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="sluice-instr-")
    policies, body = run.setup(work)

    def hot(s, calls=args.calls):
        out = subprocess.run(
            ["h2load", "-c", "10", "-m", "10", "-n", str(calls), "-d", str(body("hot")),
             "-H", "content-type: application/grpc", "-H", "te: trailers",
             f"http://127.0.0.1:{s.grpc}{run.RLS_PATH}"],
            check=True, capture_output=True, text=True).stdout
        return int(re.search(r"(\d+) succeeded", out).group(1))

    if args.quota:
        if not args.rlqsgen:
            sys.exit("instructions: --quota needs --rlqsgen")
        quota(args, work)
        return
    if not args.loadgen:
        sys.exit("instructions: --loadgen is needed")
    if args.leased:
        leased(args, work, hot)
        return
    if args.hitters:
        hitters(args, policies, work)
        return
    if args.traced:
        traced(args, policies, work, hot)
        return

    def many(s):
        out = subprocess.run(
            [args.loadgen, "--addr", f"127.0.0.1:{s.grpc}", "-c", "10", "-m", "10", "-D", "10",
             "--keys", "100000"], check=True, capture_output=True, text=True).stdout
        kv = dict(pair.split("=") for pair in out.split())
        return int(kv["ok"]) + int(kv["over_limit"])

    for spec in args.builds:
        name, binary = spec.split("=", 1)
        for scenario, drive in [("one descriptor, hot key", hot), ("two descriptors, 100k keys", many)]:
            per_call, calls = measure(binary, policies, drive, work)
            print(f"{name:<8} {scenario:<28} {per_call:>9,.0f} instructions/call over {calls:,.0f} calls",
                  flush=True)


def hitters(args, policies, work):
    def loadgen(keys, descriptors):
        def drive(s):
            out = subprocess.run(
                [args.loadgen, "--addr", f"127.0.0.1:{s.grpc}", "-c", "4", "-m", "8",
                 "--rate", str(args.rate), "--warm-up", "0", "--seconds", str(args.seconds),
                 "--keys", str(keys),
                 "--descriptors", str(descriptors)], check=True, capture_output=True,
                text=True).stdout
            kv = dict(pair.split("=", 1) for pair in out.split())
            return int(kv["ok"]) + int(kv["over_limit"])
        return drive

    modes = [("off", {"SLUICE_METRICS__TOP_KEYS": "0"}), ("top 10", {"SLUICE_METRICS__TOP_KEYS": "10"})]
    for spec in args.builds:
        name, binary = spec.split("=", 1)
        for scenario, drive in [("one descriptor, hot key", loadgen(1, 1)),
                                ("two descriptors, 100k keys", loadgen(100_000, 2))]:
            per = {}
            for mode, env in modes:
                per[mode], calls = measure(binary, policies, drive, work, (), env)
                print(f"{name:<8} {scenario:<28} {mode:<7} {per[mode]:>9,.0f} instructions/call"
                      f" over {calls:,.0f} calls", flush=True)
            print(f"{name:<8} {scenario:<28} top 10 / off: {per['top 10'] / per['off']:.3f}",
                  flush=True)


def traced(args, policies, work, hot):
    import grpc
    from concurrent import futures
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = [0]

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received[0] += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), receiver)
    port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    on = {"SLUICE_TRACING__ENABLED": "true", "SLUICE_TRACING__PROTOCOL": "grpc",
          "SLUICE_TRACING__ENDPOINT": f"http://127.0.0.1:{port}"}
    modes = [("off", {}),
             ("ratio 1", {**on, "SLUICE_TRACING__SAMPLING_RATIO": "1"}),
             ("ratio 0.01", {**on, "SLUICE_TRACING__SAMPLING_RATIO": "0.01"})]
    try:
        for spec in args.builds:
            name, binary = spec.split("=", 1)
            per = {}
            for mode, env in modes:
                before = received[0]
                per[mode], calls = measure(binary, policies, hot, work, (), env)
                # The server flushes its queue when it stops: every span has arrived by now.
                print(f"{name:<8} {mode:<10} {per[mode]:>9,.0f} instructions/call over {calls:,.0f}"
                      f" calls, {received[0] - before:,} spans received", flush=True)
            for mode in ("ratio 1", "ratio 0.01"):
                print(f"{name:<8} {mode} / off: {per[mode] / per['off']:.3f}", flush=True)
    finally:
        receiver.stop(None)


QUOTA_POLICY = """domain: quota
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 10000, burst: 10000}
"""


def quota(args, work):
    policies = Path(work, "quota")
    policies.mkdir()
    Path(policies, "quota.yaml").write_text(QUOTA_POLICY)
    for spec in args.builds:
        name, binary = spec.split("=", 1)
        for case, extra in [("shared", []), ("distinct", ["--distinct"])]:
            per, reports = quota_instructions(args, binary, policies, work, extra)
            print(f"{name:<8} {case:<9} {per:>7,.0f} instructions/report over {reports:,.0f} "
                  f"reports ({args.streams} streams x 10 buckets)", flush=True)


def quota_instructions(args, binary, policies, work, extra):
    """Instructions per bucket report of `binary` under rlqsgen's streams, and the reports."""
    proc, grpc, admin = under_callgrind(binary, policies, work)
    gen = None
    try:
        gen = subprocess.Popen(
            [args.rlqsgen, "--addr", f"127.0.0.1:{grpc}", "--streams", str(args.streams),
             "--per-connection", "100", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not gen.stdout.readline().startswith("ready"):
            sys.exit("instructions: rlqsgen did not open its streams")
        time.sleep(args.warm_up)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        first = reports_total(admin)
        time.sleep(args.seconds)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        # Read after the dump, so that every report counted in it is counted here (and the
        # few that came while it was written are counted with them).
        reports = reports_total(admin) - first
        gen.stdin.write("status\n")
        gen.stdin.flush()
        status = gen.stdout.readline().split()
        if status[:5] != ["status", "assigned", str(args.streams), "failed", "0"]:
            sys.exit(f"instructions: rlqsgen's streams did not all hold assignments: {status}")
    finally:
        if gen:
            gen.stdin.close()
            gen.wait(timeout=30)
        proc.terminate()
        proc.wait(timeout=60)
    total = callgrind.total(work, "callgrind.out")
    for p in Path(work).glob("callgrind.out*"):
        p.unlink()
    if not reports:
        sys.exit("instructions: no report was counted")
    return total / reports, reports


def reports_total(admin):
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read().decode()
    return float(re.search(r"^sluice_rlqs_reports_total (\S+)$", text, re.M).group(1))


def leased(args, work, hot):
    policies = Path(work, "over")
    policies.mkdir()
    Path(policies, "bench.yaml").write_text(
        "domain: bench\ndescriptors:\n  - key: hot\n"
        "    rate_limit: {name: hot, unit: second, requests_per_unit: 100, burst: 1000}\n")
    port = run.free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", work], stdout=subprocess.DEVNULL)
    modes = [("memory", [], {}),
             ("leased", ["--backend", "redis", "--redis-url", f"redis://127.0.0.1:{port}"],
              {"SLUICE_REDIS__LEASE__ENABLED": "true", "SLUICE_REDIS__TIMEOUT_MS": "1000"})]
    try:
        time.sleep(0.5)
        for spec in args.builds:
            name, binary = spec.split("=", 1)
            per = {}
            for mode, extra, env in modes:
                subprocess.run(["redis-cli", "-p", str(port), "FLUSHALL"], capture_output=True, check=True)
                f = {}
                # The warm-up makes the counter hot (and leased) before the count starts.
                per[mode], calls = measure(binary, policies, hot, work, extra, env,
                                           warm=lambda s: hot(s, 3_000), figures=f)
                print(f"{name:<8} {mode:<7} {per[mode]:>9,.0f} instructions/decision over {calls:,.0f}"
                      f" ({f.get('ok', 0):,.0f} OK; {f.get('by_lease', 0):,.0f} from leases,"
                      f" {f.get('by_redis', 0):,.0f} by Redis,"
                      f" {f.get('sluice_redis_round_trips_total', 0):,.0f} round trips)", flush=True)
            print(f"{name:<8} leased / memory: {per['leased'] / per['memory']:.3f}", flush=True)
    finally:
        redis.terminate()
        redis.wait()


if __name__ == "__main__":
    main()
