#!/usr/bin/env python3
"""A bounded soak of the whole server: rotating keys, paced load, policy reloads, and the
server's resident set, open files and threads sampled over time.

It starts the release server on the in-memory store, on free loopback ports, with a policy
directory in a temporary folder (the `user` and `client` rules of benches/load/bench.yaml), and
drives it from 127.0.0.1 only with the load benchmark's generator (benches/load/loadgen.rs), one
generator run per interval, paced at `--rate`. Each interval draws its descriptor values from a
window of `--keys` values that moves on by half a window per interval (`--key-offset`), so the
store keeps meeting values it has not seen while older counters fill up and are swept. Every
`--reload-every` seconds the policy file is replaced (written beside it, then renamed over it)
by the other of two valid versions, which differ in both rules' rates; `/rlconfig` must show the
version last written before the next is written, and the reload counter must go up.

Per interval it samples, from /proc, the server's VmRSS, open fds and threads (in the middle of
the interval, while the generator's connections are open), and, from the generator, the
decisions per second and the latency percentiles of the calls of that interval; from /metrics
the counters (decisions by result, reloads, keys in the store, evictions, the exposition's size).
One status line per interval; at the end the series as CSV, a JSON summary and an SVG chart.

It exits non-zero when the server died or exited badly on SIGTERM, any call was answered with
anything but OK or OVER_LIMIT (a gRPC error, a reset, a transport error, an unknown code, or a
server-counted invalid or backend_error decision), reloads did not happen or did not take effect
(or one failed), the resident set at the end exceeds the one at the end of the warm-up by more
than `--rss-bound-mib` (default 16 MiB), or the open fds by more than `--fd-bound` (default 16).

    cargo build --release --locked --bin sluice --example loadgen
    python3 benches/soak.py --short --out target/soak/short.csv     # about 26 s
    # CI: the debug build the tests made, at a pace it keeps
    python3 benches/soak.py --short --rate 1000 --rss-bound-mib 64 --bin target/debug/sluice \
        --loadgen target/debug/examples/loadgen --out target/soak/short.csv
    python3 benches/soak.py --duration 600 --out target/soak/soak.csv

The 16 MiB bound: over the full run's 8 minutes after its 2-minute warm-up, the default load
(5,000 decisions/s, two descriptors, half a window of 20,000 new values per 10 s interval) sends
2.4 million requests for about a million counters the server has never seen; keeping 24 bytes
(a store entry) of each, or 7 bytes of each request, would pass the bound. The warm-up lasts
longer than any counter's life under either policy version (a minute and the 10 s sweep), so
the store has reached its steady size before the baseline is taken.
"""

import argparse
import ctypes
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load_run_py():
    """benches/load/run.py, for its pieces (free_port, cpu_seconds)."""
    spec = importlib.util.spec_from_file_location("load_run", HERE / "load" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOAD = load_run_py()

# Two valid versions of one policy file, alternated by the reloads: the user and client rules of
# benches/load/bench.yaml (A), and the same rules tightened (B). Under B a client value drawn a
# third time within a minute is OVER_LIMIT, so the answers show which version is loaded; under A
# every answer is OK. `detailed_metric` on `user`: the request's values label its metrics, so
# rotating values also press on the cap of those series (metrics.max_detailed_series).
POLICY = """# benches/soak.py, version {version}
domain: bench
descriptors:
  - key: user
    detailed_metric: true
    rate_limit: {{name: per-user, unit: second, requests_per_unit: {user}}}
  - key: client
    rate_limit: {{name: per-client, unit: minute, requests_per_unit: {client}}}
"""
VERSIONS = {"A": {"user": 1000, "client": 60000}, "B": {"user": 500, "client": 2}}
POLICY_FILE = "bench.yaml"


def policy_text(version):
    return POLICY.format(version=version, **VERSIONS[version])


def die_with_parent():
    """In the child before exec: SIGTERM when the soak itself dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(cmd, **kwargs):
    # A session of its own: a Ctrl-C in the terminal reaches the soak, which stops its children
    # in order, rather than every process at once.
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=die_with_parent, **kwargs)


def get(port, path, timeout=5):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout).read().decode()


def scrape(admin):
    """Every sample of /metrics, by name with its labels as written, and the exposition's size."""
    text = get(admin, "/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out, len(text)


def proc_sample(pid):
    """The server's resident set (KiB), threads and open fds, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return rss, fds, threads


def host_cpu():
    """The machine's CPU time so far, all cores: (busy, total) in clock ticks, from /proc/stat."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(ticks[:8])  # guest time is already counted in user
    return total - ticks[3] - ticks[4], total  # idle and iowait are not busy


class Failed(Exception):
    pass


class Soak:
    def __init__(self, args, work):
        self.args = args
        self.work = work
        self.server = None
        self.loadgen = None
        self.rows = []
        self.problems = []
        self.rewrites = 0
        self.stale = []  # rewrites whose version /rlconfig did not show in time
        self.version = "A"
        self.server_exit = None
        self.final = {}  # the last scrape of /metrics

    # -- the server -------------------------------------------------------------------------

    def start_server(self):
        a = self.args
        self.policies = Path(self.work, "policies")
        self.policies.mkdir()
        Path(self.policies, POLICY_FILE).write_text(policy_text(self.version))
        self.grpc, self.admin = LOAD.free_port(), LOAD.free_port()
        cmd = [a.bin, "serve", "--policies", str(self.policies),
               "--grpc-addr", f"127.0.0.1:{self.grpc}", "--admin-addr", f"127.0.0.1:{self.admin}",
               "--backend", "memory", "--log-level", "warn"]
        if a.pin:
            cmd = ["taskset", "-c", "0", *cmd]
        self.log = open(Path(self.work, "server.log"), "wb")
        self.server = spawn(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(100):
            try:
                get(self.admin, "/healthcheck", timeout=1)
                return
            except OSError:
                if self.server.poll() is not None:
                    raise Failed(f"the server exited at start with {self.server.returncode}")
                time.sleep(0.1)
        raise Failed("the server did not answer /healthcheck within 10 s")

    def server_alive(self):
        if self.server.poll() is not None:
            self.server_exit = self.server.returncode
            raise Failed(f"the server died (exit status {self.server.returncode})")

    def stop(self):
        """Stops the generator and the server, whatever state they are in."""
        if self.loadgen and self.loadgen.poll() is None:
            self.loadgen.kill()
            self.loadgen.wait()
        if self.server and self.server.poll() is None:
            self.server.terminate()
            try:
                # The server answers in-flight calls for up to shutdown_grace_ms (10 s).
                self.server_exit = self.server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
                self.server_exit = "killed after 15 s"
        if self.server:
            self.log.close()

    # -- reloads ----------------------------------------------------------------------------

    def loaded_version(self):
        """The version /rlconfig shows, by the user rule's rate."""
        text = get(self.admin, "/rlconfig")
        for version, rates in VERSIONS.items():
            if re.search(rf"\.user: .*\brequests_per_unit={rates['user']}\b", text):
                return version
        return None

    def rewrite_policy(self):
        """Replaces the policy file with the other version (written beside it, renamed over it),
        after checking that the version last written is the one loaded (allowing it 2 s more
        when it is not yet, so that a slow machine is not taken for a missed reload)."""
        if self.rewrites:
            shown, late = self.loaded_version(), time.monotonic() + 2
            while shown != self.version and time.monotonic() < late:
                time.sleep(0.1)
                shown = self.loaded_version()
            if shown != self.version:
                self.stale.append((self.rewrites, self.version, shown))
        self.version = "B" if self.version == "A" else "A"
        tmp = Path(self.policies, f".{POLICY_FILE}.tmp")
        tmp.write_text(policy_text(self.version))
        os.replace(tmp, Path(self.policies, POLICY_FILE))
        self.rewrites += 1

    def reload_if_due(self):
        if time.monotonic() >= self.next_reload:
            self.rewrite_policy()
            self.next_reload += self.args.reload_every

    def wait_until(self, at):
        while (now := time.monotonic()) < at:
            self.reload_if_due()
            time.sleep(min(0.02, at - now))

    # -- the load ---------------------------------------------------------------------------

    def start_interval(self, index):
        a = self.args
        offset = index * (a.keys // 2)
        cmd = [a.loadgen, "--addr", f"127.0.0.1:{self.grpc}", "-c", str(a.connections),
               "-m", str(a.streams), "--rate", str(a.rate), "--warm-up", str(WARM_UP),
               "-D", f"{a.interval - WARM_UP - SLACK:.3f}", "--keys", str(a.keys),
               "--key-offset", str(offset)]
        if a.pin:
            cmd = ["taskset", "-c", "1", *cmd]
        self.loadgen = spawn(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return offset

    def finish_interval(self):
        out, err = self.loadgen.communicate()
        code = self.loadgen.returncode
        self.loadgen = None
        try:
            kv = dict(pair.split("=") for pair in out.split())
            res = {"rate": float(kv["rate"]), "calls": int(kv["calls"]),
                   "p50_ms": float(kv["p50_ms"]), "p99_ms": float(kv["p99_ms"]),
                   "p999_ms": float(kv["p999_ms"]), "ok": int(kv["ok"]),
                   "over_limit": int(kv["over_limit"]),
                   "client_errors": int(kv["grpc_errors"]) + int(kv["transport_errors"])
                   + int(kv["other_code"])}
        except (KeyError, ValueError):
            raise Failed(f"the load generator exited with {code} without its line:"
                         f" {out.strip()!r} {err.strip()!r}")
        if code != 0:
            res["client_errors"] = max(res["client_errors"], 1)
            self.problems.append(f"load generator exited with {code}: {err.strip()}")
        return res

    # -- the run ----------------------------------------------------------------------------

    def run(self):
        a = self.args
        self.start_server()
        t0 = time.monotonic()
        cpu0 = LOAD.cpu_seconds(self.server)
        host0 = host_cpu()
        m0, _ = scrape(self.admin)
        self.final = m0
        prev, prev_cpu, prev_t, prev_host = m0, cpu0, t0, host0
        self.next_reload = t0 + a.reload_every
        intervals = int(a.duration // a.interval)
        print(f"== soak: {a.duration:g} s = {intervals} intervals of {a.interval:g} s; server pid"
              f" {self.server.pid}, gRPC 127.0.0.1:{self.grpc}, admin 127.0.0.1:{self.admin}; load"
              f" {a.rate:,}/s paced over {a.connections} x {a.streams} streams, two descriptors,"
              f" {a.keys:,} values per interval moving on by {a.keys // 2:,}; policy rewritten every"
              f" {a.reload_every:g} s; warm-up {a.warmup:g} s; bounds: RSS +{a.rss_bound_mib:g} MiB,"
              f" fds +{a.fd_bound}", flush=True)
        for i in range(intervals):
            # Each interval starts on its own schedule, so the samples keep one phase against
            # the reloads and the store's sweep (every 10 s from the server's start).
            start = t0 + i * a.interval
            self.wait_until(start)
            self.server_alive()
            offset = self.start_interval(i)
            sample = None
            while self.loadgen.poll() is None:
                self.reload_if_due()
                if sample is None and time.monotonic() - start >= a.interval / 2:
                    self.server_alive()
                    sample = proc_sample(self.server.pid)
                time.sleep(0.02)
            res = self.finish_interval()
            self.server_alive()
            if sample is None:
                sample = proc_sample(self.server.pid)
            m, size = scrape(self.admin)
            now, cpu, host = time.monotonic(), LOAD.cpu_seconds(self.server), host_cpu()
            d = lambda k: m.get(k, 0) - prev.get(k, 0)
            ok, over = d('sluice_decisions_total{result="ok"}'), d('sluice_decisions_total{result="over_limit"}')
            server_errors = d('sluice_decisions_total{result="invalid"}') + d('sluice_decisions_total{result="backend_error"}')
            row = {
                "interval": i, "elapsed_s": round(now - t0, 2), "key_offset": offset,
                "rss_mib": round(sample[0] / 1024, 2), "fds": sample[1], "threads": sample[2],
                "decisions_per_s": round(res["rate"]), "calls": res["calls"],
                "p50_ms": res["p50_ms"], "p99_ms": res["p99_ms"], "p999_ms": res["p999_ms"],
                "ok": res["ok"], "over_limit": res["over_limit"],
                "errors": res["client_errors"] + int(server_errors),
                "server_decisions": int(ok + over),
                "server_cpu_pct": round(100 * (cpu - prev_cpu) / (now - prev_t), 1),
                # Every process on the machine, the soak's own and others', % of all cores.
                "host_cpu_pct": round(100 * (host[0] - prev_host[0]) / max(host[1] - prev_host[1], 1), 1),
                "store_keys": int(m.get("sluice_store_keys", 0)),
                "evictions": int(m.get("sluice_store_evictions_total", 0)),
                "reloads": int(m.get('sluice_policy_reloads_total{result="success"}', 0)),
                "reload_failures": int(m.get('sluice_policy_reloads_total{result="failure"}', 0)),
                "rewrites": self.rewrites, "metrics_bytes": size,
            }
            self.rows.append(row)
            prev, prev_cpu, prev_t, prev_host = m, cpu, now, host
            self.final = m
            print(f"[{row['elapsed_s']:6.1f} s] rss {row['rss_mib']:6.1f} MiB  fds {row['fds']:3}"
                  f"  thr {row['threads']:2} | {row['decisions_per_s']:>6,}/s  p50 {row['p50_ms']:.3f}"
                  f"  p99 {row['p99_ms']:.3f} ms | ok {row['ok']:>6,} over {row['over_limit']:>5,}"
                  f" err {row['errors']} | keys {row['store_keys']:>7,}  cpu {row['server_cpu_pct']:4.1f} %"
                  f" (host {row['host_cpu_pct']:3.0f} %)"
                  f" | reloads {row['reloads']}/{row['rewrites']} fail {row['reload_failures']}"
                  f"  /metrics {size / 1024:.0f} KiB", flush=True)
        # The last rewrite's reload (given up to 4 s), then the counters once more.
        late = time.monotonic() + 4
        while self.rewrites and time.monotonic() < late:
            self.server_alive()
            if self.loaded_version() == self.version:
                break
            time.sleep(0.1)
        else:
            if self.rewrites:
                self.stale.append((self.rewrites, self.version, self.loaded_version()))
        time.sleep(0.5)  # the reload counter is counted after the swap
        self.final, _ = scrape(self.admin)


# The generator's own warm-up (paced, not measured) and the time it takes to start and drain:
# together with its measured seconds they make one interval.
WARM_UP, SLACK = 0.25, 0.15


def summarize(soak, args):
    rows = soak.rows
    f = soak.final
    problems = list(soak.problems)
    summary = {"rows": len(rows)}
    if rows:
        # The baseline: the sample of the interval that ends the warm-up (on its schedule).
        base = next((r for r in rows if (r["interval"] + 1) * args.interval >= args.warmup - 1e-6),
                    rows[-1])
        last = rows[-1]
        rss = [r["rss_mib"] for r in rows]
        p99 = [r["p99_ms"] for r in rows]
        summary.update({
            "elapsed_s": last["elapsed_s"],
            "rss_mib": {"first": rss[0], "after_warmup": base["rss_mib"], "last": rss[-1],
                        "min": min(rss), "max": max(rss)},
            "rss_growth_after_warmup_mib": round(last["rss_mib"] - base["rss_mib"], 2),
            "fds": {"first": rows[0]["fds"], "after_warmup": base["fds"], "last": last["fds"],
                    "max": max(r["fds"] for r in rows)},
            "threads": {"first": rows[0]["threads"], "last": last["threads"],
                        "max": max(r["threads"] for r in rows)},
            "p99_ms": {"median": statistics.median(p99), "max": max(p99), "min": min(p99)},
            "decisions_per_s_median": statistics.median(r["decisions_per_s"] for r in rows),
            "client_calls": sum(r["calls"] for r in rows),
            "server_decisions": int(f.get('sluice_decisions_total{result="ok"}', 0)
                                    + f.get('sluice_decisions_total{result="over_limit"}', 0)),
            "over_limit": int(f.get('sluice_decisions_total{result="over_limit"}', 0)),
            "errors": sum(r["errors"] for r in rows),
            "store_keys_max": max(r["store_keys"] for r in rows),
            "evictions": int(f.get("sluice_store_evictions_total", 0)),
            "metrics_bytes": {"first": rows[0]["metrics_bytes"], "last": last["metrics_bytes"]},
        })
        growth = summary["rss_growth_after_warmup_mib"]
        if growth > args.rss_bound_mib:
            problems.append(f"RSS grew {growth:.1f} MiB from the end of the warm-up"
                            f" ({base['rss_mib']:.1f} MiB at {base['elapsed_s']:.0f} s) to the end"
                            f" ({last['rss_mib']:.1f} MiB): bound {args.rss_bound_mib:g} MiB")
        if last["fds"] - base["fds"] > args.fd_bound:
            problems.append(f"open fds grew from {base['fds']} (end of warm-up) to {last['fds']}:"
                            f" bound +{args.fd_bound}")
        if summary["errors"]:
            problems.append(f"{summary['errors']} calls answered with neither OK nor OVER_LIMIT")
        if not summary["client_calls"]:
            problems.append("no decisions were measured")
    reloads = int(f.get('sluice_policy_reloads_total{result="success"}', 0))
    failures = int(f.get('sluice_policy_reloads_total{result="failure"}', 0))
    summary.update(rewrites=soak.rewrites, reloads=reloads, reload_failures=failures,
                   stale_reloads=len(soak.stale))
    if soak.rewrites == 0 or reloads < soak.rewrites:
        problems.append(f"{soak.rewrites} policy rewrites but {reloads} successful reloads")
    if failures:
        problems.append(f"{failures} failed reloads")
    for n, want, shown in soak.stale:
        problems.append(f"after rewrite {n} /rlconfig showed version {shown}, not {want}")
    if soak.server_exit not in (None, 0) and not any("server died" in p for p in problems):
        problems.append(f"the server exited with {soak.server_exit}")
    summary["problems"] = problems
    summary["passed"] = not problems
    return summary


def print_summary(s, args):
    print("== summary")
    if s["rows"]:
        r, fd, th, p = s["rss_mib"], s["fds"], s["threads"], s["p99_ms"]
        print(f"RSS MiB: first {r['first']:.1f}, after warm-up ({args.warmup:g} s) {r['after_warmup']:.1f},"
              f" last {r['last']:.1f}, min {r['min']:.1f}, max {r['max']:.1f};"
              f" growth after warm-up {s['rss_growth_after_warmup_mib']:+.1f} (bound +{args.rss_bound_mib:g})")
        print(f"fds: first {fd['first']}, last {fd['last']}, max {fd['max']};"
              f" threads: first {th['first']}, last {th['last']}, max {th['max']}")
        print(f"p99 ms per interval: median {p['median']:.3f}, max {p['max']:.3f};"
              f" decisions/s median {s['decisions_per_s_median']:,.0f}")
        print(f"decisions: {s['client_calls']:,} measured by the generator, {s['server_decisions']:,}"
              f" counted by the server ({s['over_limit']:,} OVER_LIMIT); errors {s['errors']};"
              f" store keys at most {s['store_keys_max']:,}, evictions {s['evictions']}")
    print(f"reloads: {s['reloads']} successful, {s['reload_failures']} failed, for {s['rewrites']}"
          f" rewrites; {s['stale_reloads']} not shown by /rlconfig in time")
    for problem in s["problems"]:
        print(f"!! {problem}")
    print("PASS" if s["passed"] else "FAIL", flush=True)


def svg_chart(rows, args):
    """RSS and p99 over time, two panels, as plain SVG."""
    W, H, L, R, T, GAP, PH = 760, 420, 60, 20, 30, 50, 150
    xmax = max(args.duration, rows[-1]["elapsed_s"])
    x = lambda t: L + (W - L - R) * t / xmax
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{W}" height="{H}" fill="white"/>']

    def panel(top, key, label, color):
        vals = [r[key] for r in rows]
        hi = max(vals) * 1.15 or 1
        y = lambda v: top + PH - PH * v / hi
        parts.append(f'<text x="{L}" y="{top - 8}" font-weight="bold">{label}</text>')
        parts.append(f'<rect x="{L}" y="{top}" width="{W - L - R}" height="{PH}" fill="none" stroke="#999"/>')
        for k in range(5):
            v = hi * k / 4
            parts.append(f'<line x1="{L}" x2="{W - R}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>')
            parts.append(f'<text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
        wx = x(args.warmup)
        parts.append(f'<line x1="{wx:.1f}" x2="{wx:.1f}" y1="{top}" y2="{top + PH}" stroke="#aaa" stroke-dasharray="4 3"/>')
        pts = " ".join(f"{x(r['elapsed_s']):.1f},{y(r[key]):.1f}" for r in rows)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for t in range(0, int(xmax) + 1, max(1, int(xmax) // 10)):
            parts.append(f'<text x="{x(t):.1f}" y="{top + PH + 14}" text-anchor="middle">{t}</text>')

    panel(T, "rss_mib", "server VmRSS, MiB (dashed: end of warm-up)", "#1f77b4")
    panel(T + PH + GAP, "p99_ms", "p99 per interval, ms (client-measured)", "#d62728")
    parts.append(f'<text x="{W / 2}" y="{H - 6}" text-anchor="middle">elapsed, s</text></svg>')
    return "\n".join(parts) + "\n"


def write_outputs(soak, summary, args):
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = list(soak.rows[0]) if soak.rows else ["interval"]
    with open(out, "w") as fh:
        fh.write(",".join(fields) + "\n")
        for r in soak.rows:
            fh.write(",".join(str(r[k]) for k in fields) + "\n")
    meta = {"args": {k: v for k, v in vars(args).items()},
            "commit": args.commit or git_commit(), "checkout_head": git_commit(),
            "nproc": os.cpu_count(),
            "policy_versions": VERSIONS, "summary": summary}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    written = [str(out), str(out.with_suffix(".json"))]
    if soak.rows:
        out.with_suffix(".svg").write_text(svg_chart(soak.rows, args))
        written.append(str(out.with_suffix(".svg")))
    print("wrote " + ", ".join(written))


def git_commit():
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("SOAK_BIN", str(ROOT / "target/release/sluice")))
    ap.add_argument("--loadgen", default=os.environ.get("SOAK_LOADGEN",
                                                        str(ROOT / "target/release/examples/loadgen")))
    ap.add_argument("--short", action="store_true",
                    help="the CI form: 24 s in 4 s intervals, a rewrite every 2 s, 8 s of warm-up")
    ap.add_argument("--duration", type=float, help="seconds of load (default 600; 24 with --short)")
    ap.add_argument("--interval", type=float, help="seconds per sample (default 10; 4 with --short)")
    ap.add_argument("--reload-every", type=float, help="seconds between policy rewrites (default 5; 2 with --short)")
    ap.add_argument("--warmup", type=float,
                    help="seconds before the RSS and fd baseline (default a fifth of the duration, at most 120)")
    ap.add_argument("--rate", type=int, default=5000, help="decisions per second offered (default 5000)")
    ap.add_argument("--keys", type=int, default=20000,
                    help="distinct values per descriptor in an interval; the window moves on by half of it")
    ap.add_argument("-c", "--connections", type=int, default=4)
    ap.add_argument("-m", "--streams", type=int, default=4)
    ap.add_argument("--rss-bound-mib", type=float, default=16.0)
    ap.add_argument("--fd-bound", type=int, default=16)
    ap.add_argument("--pin", action="store_true",
                    help="the server on core 0 and the load on core 1 (taskset), as benches/load/run.py")
    ap.add_argument("--commit", default=os.environ.get("SOAK_COMMIT"),
                    help="the commit --bin was built from, for the JSON (default: this checkout's HEAD)")
    ap.add_argument("--out", default=str(ROOT / "target/soak/soak.csv"),
                    help="the CSV; the JSON summary and the SVG go beside it (.json, .svg)")
    args = ap.parse_args()
    short = args.short
    args.duration = args.duration or (24 if short else 600)
    args.interval = args.interval or (4 if short else 10)
    args.reload_every = args.reload_every or (2 if short else 5)
    if args.warmup is None:
        args.warmup = 8 if short else min(120, args.duration / 5)
    if args.interval <= WARM_UP + SLACK + 0.5 or args.duration < args.interval:
        ap.error("--interval must exceed 0.9 s and --duration must hold one interval")
    if args.keys < 2:
        ap.error("--keys must be at least 2")
    for path, what in [(args.bin, "the server"), (args.loadgen, "the load generator")]:
        if not os.access(path, os.X_OK):
            sys.exit(f"soak: {what} is not at {path}: cargo build --release --locked --bin sluice"
                     f" --example loadgen (or pass --bin / --loadgen)")

    # SIGTERM and SIGHUP end the soak as Ctrl-C does: through the finally below.
    def interrupted(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)

    work = tempfile.mkdtemp(prefix="sluice-soak-")
    soak = Soak(args, work)
    code = 0
    try:
        soak.run()
    except Failed as e:
        soak.problems.append(str(e))
    except KeyboardInterrupt:
        soak.problems.append("interrupted")
        code = 130
    finally:
        soak.stop()
        log = Path(work, "server.log")
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(soak, args)
    print_summary(summary, args)
    if tail:
        print("== the server's log (warnings and errors), last lines")
        print("\n".join(tail))
    write_outputs(soak, summary, args)
    sys.exit(code or (0 if summary["passed"] else 1))


if __name__ == "__main__":
    main()
