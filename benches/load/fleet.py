#!/usr/bin/env python3
"""The quota fleet's cost to Redis: two sluice nodes on one Redis, each with streams watching the
same --rules rules (a policy `key: tenant` gives each tenant a rule of its own), so that every
tick each node renews its part of every rule in the rules' fleet tables.

Starts redis-server (core 1) and two nodes (run.py's Server, core 0), opens --streams streams
on each node, each reporting its slice of the tenants {tenant: t0}.. every --interval seconds
(quota.py's Envoy: Envoy's generated stubs, asyncio gRPC, on core 0 beside the nodes, so that
redis-server has a core to itself), waits until both nodes watch every rule, then resets Redis's
statistics and measures over --ticks ticks (a tick is a quarter of `rlqs.assignment_ttl_ms`,
at most 1 s): the script calls Redis ran (`INFO commandstats`, `cmdstat_evalsha` and
`cmdstat_eval`), the time it spent in them and redis-server's CPU time (/proc, which adds the
commands' reading and answering), per fleet tick: both nodes renewing every rule once, counted
by the renewals Redis made (one `HSET` each). Nothing
else reaches Redis once the buckets are assigned (RLQS counts nothing there). A status line
every few seconds while it runs; exits 1 when a stream fails or the calls per tick pass 2 % of
the rules (--no-target to only report).

    cargo build --bin sluice
    target/interop-venv/bin/python benches/load/fleet.py --bin target/debug/sluice
"""

import argparse
import asyncio
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from quota import Envoy, metrics  # noqa: E402
from run import Server, cpu_seconds  # noqa: E402

POLICY = """domain: quota
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 1000, burst: 1000}
"""
TTL_MS = 10_000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_cli(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                          check=True).stdout


def script_stats(port):
    """Redis's figures since the last reset: script calls and the µs spent in them (EVALSHA and
    EVAL together), and the renewals they made (one HSET each, in either version's script)."""
    out = redis_cli(port, "INFO", "commandstats")
    calls = usec = 0
    for m in re.finditer(r"^cmdstat_(?:evalsha|eval):calls=(\d+),usec=(\d+)", out, re.M):
        calls, usec = calls + int(m.group(1)), usec + int(m.group(2))
    hset = re.search(r"^cmdstat_hset:calls=(\d+)", out, re.M)
    return calls, usec, int(hset.group(1)) if hset else 0


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/debug/sluice")
    ap.add_argument("--rules", type=int, default=10_000)
    ap.add_argument("--streams", type=int, default=10, help="streams per node")
    ap.add_argument("--interval", type=float, default=4.0,
                    help="seconds between a stream's reports (under the 10 s TTL)")
    ap.add_argument("--ticks", type=int, default=15, help="ticks measured")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds after every rule is watched")
    ap.add_argument("--no-target", action="store_true", help="report only, whatever the calls")
    args = ap.parse_args()
    # Beside the nodes, so that redis-server has core 1 to itself and its times are its own.
    os.sched_setaffinity(0, {0})
    tick = min(TTL_MS / 4 / 1000, 1.0)

    work = tempfile.TemporaryDirectory(prefix="sluice-fleet-")
    policies = Path(work.name, "policies")
    policies.mkdir()
    (policies / "fleet.yaml").write_text(POLICY)
    port = free_port()
    redis = subprocess.Popen(["taskset", "-c", "1", "redis-server", "--port", str(port), "--bind",
                              "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", work.name],
                             stdout=subprocess.DEVNULL)
    for _ in range(100):
        try:
            if redis_cli(port, "PING").strip() == "PONG":
                break
        except subprocess.CalledProcessError:
            pass
        time.sleep(0.05)
    per_stream = -(-args.rules // args.streams)
    env = {
        "SLUICE_RLQS__ASSIGNMENT_TTL_MS": str(TTL_MS),
        "SLUICE_RLQS__MAX_STREAMS": str(args.streams + 10),
        "SLUICE_RLQS__MAX_STREAMS_PER_PEER": str(args.streams + 10),
        "SLUICE_RLQS__MAX_BUCKETS_PER_STREAM": str(per_stream),
        # A saturated 2-core machine is slower than production: give Redis 100 ms, not 10.
        "SLUICE_REDIS__TIMEOUT_MS": "100",
    }
    extra = ["--backend", "redis", "--redis-url", f"redis://127.0.0.1:{port}"]
    nodes = []
    stop = asyncio.Event()
    channels, envoys, tasks = [], [], []
    try:
        nodes = [Server(args.bin, str(policies), extra=extra, env=env) for _ in range(2)]
        tenants = [f"t{i}" for i in range(args.rules)]
        for node in nodes:
            for s in range(args.streams):
                channel = grpc.aio.insecure_channel(
                    f"127.0.0.1:{node.grpc}", options=[("grpc.use_local_subchannel_pool", 1)])
                channels.append(channel)
                envoy = Envoy(rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel),
                              tenants[s * per_stream:(s + 1) * per_stream], args.interval)
                envoys.append(envoy)
                tasks.append(asyncio.create_task(envoy.run(stop)))

        def status(phase, extra=""):
            watched = [metrics(n.admin).get("sluice_rlqs_buckets", 0) for n in nodes]
            assigned = sum(len(e.rates) for e in envoys)
            failed = sum(e.error is not None for e in envoys)
            print(f"fleet: {phase:>8} buckets watched {watched[0]:.0f} + {watched[1]:.0f}, "
                  f"assigned {assigned}/{2 * args.rules}, failed {failed}{extra}",
                  file=sys.stderr, flush=True)
            return watched

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            await asyncio.sleep(2.0)
            watched = status("joining")
            if any(e.error for e in envoys):
                break
            if all(w >= args.rules for w in watched):
                break
        await asyncio.sleep(args.warmup)
        status("warm")
        redis_cli(port, "CONFIG", "RESETSTAT")
        cpu0, t0 = cpu_seconds(redis), time.monotonic()
        end = t0 + args.ticks * tick
        while time.monotonic() < end:
            await asyncio.sleep(min(3.0, end - time.monotonic()))
            calls, usec, renewals = script_stats(port)
            status("measured", f", script calls {calls} for {renewals} renewals, Redis "
                               f"{usec / 1000:.0f} ms")
            if any(e.error for e in envoys):
                break
        span, cpu = time.monotonic() - t0, cpu_seconds(redis) - cpu0
        calls, usec, renewals = script_stats(port)
        # A tick of the fleet: both nodes renewing every rule. Counted by the renewals Redis
        # made, not by the clock, so that a node whose ticks run late (a debug build under the
        # reports' load) is not counted as cheaper.
        ticks = renewals / (2 * args.rules)
        failed = [e.error for e in envoys if e.error]
        per_tick = calls / max(ticks, 1e-9)
        print(f"\nquota fleet: 2 nodes x {args.rules} watched rules, {args.streams} streams a node, "
              f"one Redis ({args.bin})")
        print(f"  measured {span:.1f} s ({span / tick:.1f} ticks of {tick:g} s due): {calls} script "
              f"calls, {renewals} renewals ({ticks:.1f} fleet ticks), Redis {usec / 1000:.1f} ms in "
              f"the scripts, redis-server CPU {cpu:.2f} s")
        print(f"  per fleet tick (both nodes renewing every rule): {per_tick:.1f} calls "
              f"({100 * per_tick / args.rules:.2f} % of the rules), Redis {usec / ticks / 1000:.1f} ms "
              f"in the scripts ({usec / max(calls, 1):.0f} µs a call), redis-server CPU "
              f"{cpu * 1000 / ticks:.0f} ms")
        if failed:
            print(f"  FAILED: {len(failed)} streams ended with an error ({failed[0].code()})",
                  file=sys.stderr)
            return 1
        if per_tick > 0.02 * args.rules and not args.no_target:
            print("  ABOVE TARGET: more calls per tick than 2 % of the rules", file=sys.stderr)
            return 1
        return 0
    finally:
        stop.set()
        for c in channels:
            await c.close()
        for t in tasks:
            t.cancel()
        for node in nodes:
            node.stop()
        redis.terminate()
        redis.wait(timeout=10)
        work.cleanup()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
