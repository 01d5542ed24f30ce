#!/usr/bin/env python3
"""The capacity of the Rate Limit Quota Service (RLQS): many Envoys, each on a stream of its own,
reporting their buckets every second, as Envoy's rate_limit_quota filter does.

Starts the server (run.py's Server: pinned to core 0, the load on core 1) with one rule of
10,000 a second and opens --streams streams, one per connection by default, each reporting the
same --buckets buckets ({tenant: t0}..) at 5 requests/s each, every --interval seconds, with
Envoy's generated stubs (asyncio gRPC). Every stream shares each bucket's counter with every
other, the table's costliest case: each share is divided among all the streams (--distinct:
each stream's buckets are its own, {tenant: s<stream>-t<i>}). After a warm-up,
it measures over --seconds the server's CPU time (/proc) per usage report received
(sluice_rlqs_reports_total) and its resident set. Then it halves the rule in the policy file
(sluice reloads on the change) and times how long until every stream holds its new assignment
for every bucket. A status line every few seconds while it runs; exits 1 when a stream fails.

The Python streams top out near 26,000 bucket reports a second on one core. `--generator rust`
sends the same messages from the `rlqsgen` example instead (--gen-bin; benches/load/rlqsgen.rs),
a process of its own on core 1 that keeps the streams' rates and times the reload, driven over
its stdin and stdout; this script still starts the server, reads its counters and CPU, rewrites
the policy and prints the same lines. It reaches 100,000 reports a second (10,000 streams x 10
buckets, --per-connection 100).

`--beside B` runs a second server, build B, beside the first, each with its own policy file and
its own Rust generator (both servers on core 0, both generators on core 1), so that both are
measured over the same seconds and the machine's drift falls on both alike. The measured span is
cut into windows of about five seconds; besides each server's figures, it prints B's CPU per
report over the first's in each window, their median and their range. The reload is then timed
on each server in turn. The place is not quite fair: the same build started second read 5 % more
CPU per report in one run, so compare two builds in both orders and take the geometric mean of
B/A and 1 / (A/B).

    cargo build --release --bin sluice
    target/interop-venv/bin/python benches/load/quota.py --bin target/release/sluice
    cargo build --release --bin sluice --example rlqsgen
    target/interop-venv/bin/python benches/load/quota.py --bin target/release/sluice \
        --generator rust --streams 10000 --per-connection 100
    target/interop-venv/bin/python benches/load/quota.py --bin OLD/sluice --beside NEW/sluice \
        --generator rust --streams 10000 --per-connection 100 --distinct --seconds 60
"""

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from run import Server, cpu_seconds  # noqa: E402

RATE = 10_000
DEMAND = 5
POLICY = """domain: quota
descriptors:
  - key: tenant
    rate_limit: {{unit: second, requests_per_unit: {rate}, burst: {rate}}}
"""
Reports = rlqs_pb2.RateLimitQuotaUsageReports


def metrics(admin):
    """The server's RLQS counters and gauges, by name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(sluice_rlqs_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def rss_mib(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


def rate(action):
    b = action.quota_assignment_action.rate_limit_strategy.token_bucket
    interval = b.fill_interval.seconds + b.fill_interval.nanos / 1e9
    return b.tokens_per_fill.value / interval if interval > 0 else 0.0


class Envoy:
    """One stream: reports its buckets every interval and keeps the latest rate of each."""

    def __init__(self, stub, buckets, interval):
        self.stub, self.buckets, self.interval = stub, buckets, interval
        self.rates = {}
        self.sent = 0
        self.error = None
        self.updated = None  # when every bucket last held a rate below the reload's mark
        self.mark = None

    def message(self, first):
        usages = []
        for b in self.buckets:
            u = Reports.BucketQuotaUsage(bucket_id=rlqs_pb2.BucketId(bucket={"tenant": b}),
                                         num_requests_allowed=int(DEMAND * self.interval))
            u.time_elapsed.FromNanoseconds(int(self.interval * 1e9))
            usages.append(u)
        return Reports(domain="quota" if first else "", bucket_quota_usages=usages)

    async def requests(self, stop):
        first = True
        while not stop.is_set():
            yield self.message(first)
            self.sent += 1
            first = False
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    async def run(self, stop):
        try:
            call = self.stub.StreamRateLimitQuotas(self.requests(stop))
            async for answer in call:
                for action in answer.bucket_action:
                    if action.HasField("quota_assignment_action"):
                        self.rates[action.bucket_id.bucket["tenant"]] = rate(action)
                if (self.mark is not None and self.updated is None
                        and len(self.rates) == len(self.buckets)
                        and all(r <= self.mark for r in self.rates.values())):
                    self.updated = time.monotonic()
        except grpc.aio.AioRpcError as e:
            if not stop.is_set():
                self.error = e


class RustLoad:
    """The streams of the Rust generator (`rlqsgen`), a process on core 1 driven over its stdin
    and stdout, one command a line and one line of answer (benches/load/rlqsgen.rs)."""

    def __init__(self, proc, streams):
        self.proc, self.streams = proc, streams

    @classmethod
    async def start(cls, binary, server, args):
        cmd = ["taskset", "-c", "1", binary, "--addr", f"127.0.0.1:{server.grpc}",
               "--streams", str(args.streams), "--buckets", str(args.buckets),
               "--interval", str(args.interval), "--per-connection", str(args.per_connection)]
        if args.distinct:
            cmd.append("--distinct")
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        load = cls(proc, args.streams)
        ready = await load.line()
        if not ready.startswith("ready"):
            raise RuntimeError(f"rlqsgen: {ready!r} where 'ready' was expected")
        return load

    async def line(self):
        line = (await self.proc.stdout.readline()).decode().strip()
        if not line:
            raise RuntimeError(f"rlqsgen ended (exit {await self.proc.wait()})")
        return line

    async def ask(self, command):
        """The answer to `command`, as its words after the first."""
        self.proc.stdin.write(f"{command}\n".encode())
        await self.proc.stdin.drain()
        words = (await self.line()).split()
        if words[0] == "error":
            raise RuntimeError(f"rlqsgen: {' '.join(words[1:])}")
        return words[1:]

    async def counts(self):
        """(streams holding a rate for every bucket, streams failed)"""
        w = await self.ask("status")
        return int(w[1]), int(w[3])

    async def close(self):
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class Rig:
    """One server with its own policy file and, with the Rust generator, its own streams."""

    def __init__(self, binary, args):
        self.binary = binary
        self.work = tempfile.TemporaryDirectory(prefix="sluice-quota-")
        self.policies = Path(self.work.name, "policies")
        self.policies.mkdir()
        self.policy = self.policies / "quota.yaml"
        self.policy.write_text(POLICY.format(rate=RATE))
        self.server = Server(binary, str(self.policies), env={
            "SLUICE_RLQS__MAX_STREAMS": str(args.streams + 10),
            # Every stream comes from 127.0.0.1: one peer.
            "SLUICE_RLQS__MAX_STREAMS_PER_PEER": str(args.streams + 10),
            "SLUICE_RLQS__MAX_BUCKETS_PER_STREAM": str(max(args.buckets, 1000)),
        })
        self.rss_idle = rss_mib(self.server.proc.pid)
        self.rust = None

    def snapshot(self):
        """(reports so far, server CPU, generator CPU)"""
        reports = metrics(self.server.admin)["sluice_rlqs_reports_total"]
        gen = cpu_seconds(self.rust.proc) if self.rust else 0.0
        return reports, cpu_seconds(self.server.proc), gen

    def reload(self):
        """Halves the rule, as an operator's edit would: a new file renamed over the old."""
        tmp = self.policies / ".quota.tmp"
        tmp.write_text(POLICY.format(rate=RATE // 2))
        tmp.rename(self.policy)

    async def close(self):
        if self.rust:
            await self.rust.close()
        self.server.stop()
        self.work.cleanup()


def per_report(a, b):
    """CPU µs per report between two snapshots."""
    return (b[1] - a[1]) * 1e6 / max(b[0] - a[0], 1)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/sluice")
    ap.add_argument("--beside", metavar="BIN",
                    help="a second build, run and measured at the same time as --bin (needs"
                         " --generator rust)")
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--buckets", type=int, default=10)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between reports")
    ap.add_argument("--per-connection", type=int, default=1, help="streams per connection")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=30.0, help="the measured span")
    ap.add_argument("--distinct", action="store_true",
                    help="each stream reports buckets of its own instead of the same ones")
    ap.add_argument("--generator", choices=["python", "rust"], default="python",
                    help="the streams from Envoy's Python stubs in this process, or from the Rust"
                         " generator (--gen-bin) as a process of its own on core 1")
    ap.add_argument("--gen-bin", default="target/release/examples/rlqsgen",
                    help="the Rust generator, for --generator rust")
    args = ap.parse_args()
    if args.beside and args.generator != "rust":
        ap.error("--beside needs --generator rust: the Python streams of two servers would share"
                 " this process's one core")
    os.sched_setaffinity(0, {1})

    stop = asyncio.Event()
    channels = []
    envoys = []
    tasks = []
    rigs = []
    try:
        for binary in [args.bin] + ([args.beside] if args.beside else []):
            rigs.append(Rig(binary, args))
        for rig in rigs:
            if args.generator == "rust":
                rig.rust = await RustLoad.start(args.gen_bin, rig.server, args)
        server = rigs[0].server
        for i in range(args.streams if args.generator == "python" else 0):
            prefix = f"s{i}-" if args.distinct else ""
            buckets = [f"{prefix}t{b}" for b in range(args.buckets)]
            if i % args.per_connection == 0:
                # A pool of its own, so each channel is a connection of its own.
                channels.append(grpc.aio.insecure_channel(
                    f"127.0.0.1:{server.grpc}", options=[("grpc.use_local_subchannel_pool", 1)]))
            envoy = Envoy(rlqs_pb2_grpc.RateLimitQuotaServiceStub(channels[-1]), buckets,
                          args.interval)
            envoys.append(envoy)
            tasks.append(asyncio.create_task(envoy.run(stop)))
            if i % 50 == 49:
                await asyncio.sleep(0.05)

        async def counts(rig):
            """(streams holding a rate for every bucket, streams failed)"""
            if rig.rust:
                return await rig.rust.counts()
            return (sum(len(e.rates) == args.buckets for e in envoys),
                    sum(e.error is not None for e in envoys))

        async def status(phase):
            failed = 0
            for n, rig in enumerate(rigs):
                m = metrics(rig.server.admin)
                assigned, f = await counts(rig)
                failed += f
                name = f" [{n + 1}]" if len(rigs) > 1 else ""
                print(f"quota{name}: {phase:>8} streams {m.get('sluice_rlqs_streams', 0):.0f} "
                      f"buckets {m.get('sluice_rlqs_buckets', 0):.0f} reports "
                      f"{m.get('sluice_rlqs_reports_total', 0):.0f} "
                      f"assigned {assigned}/{args.streams} failed {f} "
                      f"rss {rss_mib(rig.server.proc.pid):.1f} MiB", file=sys.stderr, flush=True)
            return failed

        async def wait(seconds, phase):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await asyncio.sleep(min(5.0, end - time.monotonic()))
                if await status(phase):
                    break

        await wait(args.warmup, "warm-up")
        # The span in windows of about five seconds, each rig's snapshot at each window's edge.
        windows = max(1, round(args.seconds / 5))
        t0 = time.monotonic()
        edges = [[rig.snapshot() for rig in rigs]]
        for w in range(windows):
            await asyncio.sleep(max(0.0, t0 + args.seconds * (w + 1) / windows - time.monotonic()))
            edges.append([rig.snapshot() for rig in rigs])
            if await status("measured"):
                break
        span = time.monotonic() - t0

        kind = "distinct" if args.distinct else "shared"
        failures = 0
        for n, rig in enumerate(rigs):
            first, last = edges[0][n], edges[-1][n]
            failures += await report(rig, args, kind, span, first, last, envoys)
        if len(rigs) > 1:
            ratios = sorted(per_report(a[1], b[1]) / per_report(a[0], b[0])
                            for a, b in zip(edges, edges[1:]))
            whole = per_report(edges[0][1], edges[-1][1]) / per_report(edges[0][0], edges[-1][0])
            print(f"\n{args.beside} beside {args.bin}: CPU per bucket report {whole:.3f}x over "
                  f"the span; by window of {span / len(ratios):.1f} s, median "
                  f"{statistics.median(ratios):.3f}x, range {ratios[0]:.3f}x - {ratios[-1]:.3f}x "
                  f"({len(ratios)} windows)")
        return 1 if failures else 0
    finally:
        stop.set()
        for c in channels:
            await c.close()
        for t in tasks:
            t.cancel()
        for rig in rigs:
            await rig.close()


async def report(rig, args, kind, span, first, last, envoys):
    """Prints the rig's figures over the measured span, then reloads its policy and times every
    stream's new assignment. Returns 1 when a stream failed or missed it."""
    rust = rig.rust
    reports = last[0] - first[0]
    cpu = last[1] - first[1]
    gen_cpu = last[2] - first[2]
    rss = rss_mib(rig.server.proc.pid)
    messages = reports / args.buckets

    if rust:
        old_share = float((await rust.ask("share"))[0])
        await rust.ask(f"mark {old_share * 0.6!r}")
    else:
        before = sorted(r for e in envoys for r in e.rates.values())
        old_share = before[len(before) // 2] if before else 0.0
        for e in envoys:
            e.mark = old_share * 0.6
    cpu_r0 = cpu_seconds(rig.server.proc)
    reloaded_at = time.monotonic()
    rig.reload()
    if rust:
        # done <timed> <streams> median <s> p99 <s> all <s> share <r> failed <n> codes <..>
        w = await rust.ask("wait 60")
        cpu_reload = cpu_seconds(rig.server.proc) - cpu_r0
        timed, median, p99, latest, new_share = int(w[0]), *map(float, w[3:10:2])
        failures, codes = int(w[11]), w[13]
    else:
        deadline = reloaded_at + 60
        while time.monotonic() < deadline and not all(e.updated for e in envoys):
            await asyncio.sleep(0.05)
        cpu_reload = cpu_seconds(rig.server.proc) - cpu_r0
        done = sorted(e.updated - reloaded_at for e in envoys if e.updated)
        after = sorted(r for e in envoys for r in e.rates.values())
        failed = [e.error for e in envoys if e.error]
        p = lambda q: done[min(len(done) - 1, int(q * len(done)))]  # noqa: E731
        timed, failures = len(done), len(failed)
        if done:
            median, p99, latest, new_share = p(0.5), p(0.99), done[-1], after[len(after) // 2]
        codes = failed[0].code() if failed else ""

    print(f"\nRLQS capacity: {args.streams} streams x {args.buckets} {kind} buckets, a report "
          f"every {args.interval:g} s, {args.per_connection} stream(s) per connection "
          f"({rig.binary})" + (f", from {args.gen_bin}" if rust else ""))
    print(f"  measured {span:.1f} s: {reports:.0f} bucket reports ({reports / span:.0f}/s) in "
          f"{messages:.0f} messages; server CPU {cpu:.2f} s ({100 * cpu / span:.1f} % of a core)")
    print(f"  CPU per bucket report {cpu * 1e6 / max(reports, 1):.1f} µs, per message "
          f"{cpu * 1e6 / max(messages, 1):.1f} µs")
    if rust:
        print(f"  generator CPU {gen_cpu:.2f} s ({100 * gen_cpu / span:.1f} % of a core)")
    print(f"  resident set {rss:.1f} MiB with the streams open ({rig.rss_idle:.1f} MiB before any)")
    print(f"  share per stream and bucket {old_share:.3f}/s of {RATE}/s")
    if timed:
        print(f"  reload to {RATE // 2}/s: {timed}/{args.streams} streams held the new "
              f"assignment for every bucket after median {median:.2f} s, p99 {p99:.2f} s, "
              f"all {latest:.2f} s (new share {new_share:.3f}/s); server CPU "
              f"{cpu_reload:.2f} s meanwhile")
    if failures or timed < args.streams:
        print(f"  FAILED: {failures} streams ended with an error "
              f"({codes}), {args.streams - timed} without the "
              f"new assignment", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
