#!/usr/bin/env python3
"""Instructions per ShouldRateLimit call, counted by callgrind: a machine-independent figure that
other load on the machine does not move. Runs each given server build under
`valgrind --tool=callgrind`, zeroes the counters once it is healthy, drives it with h2load (a fixed
count of hot-key calls) and with loadgen (two descriptors over 100,000 keys, for a fixed time),
dumps, and divides the instructions by the decisions the server itself counted (by the calls the
driver saw answered for a bench-floor build, which decides nothing and counts no decision).

    python3 benches/load/instructions.py --loadgen LOADGEN NAME=BIN [NAME=BIN ...]
"""

import argparse
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


def decisions(admin):
    m = run.metrics(admin)
    return sum(m.get(k, 0) for k in ("ok", "over_limit", "invalid", "backend_error"))


def measure(binary, policies, drive, work):
    out = Path(work, "callgrind.out")
    grpc, admin = run.free_port(), run.free_port()
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", binary, "serve",
         "--policies", str(policies), "--grpc-addr", f"127.0.0.1:{grpc}",
         "--admin-addr", f"127.0.0.1:{admin}", "--log-level", "error"],
        stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin}/healthcheck", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit("instructions: the server did not start under valgrind")
        server = type("S", (), {"grpc": grpc, "admin": admin})
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        before = decisions(admin)
        answered = drive(server)
        after = decisions(admin)
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
    ap.add_argument("--loadgen", required=True)
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("builds", nargs="+", metavar="NAME=BIN")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="sluice-instr-")
    policies, body = run.setup(work)

    def hot(s):
        out = subprocess.run(
            ["h2load", "-c", "10", "-m", "10", "-n", str(args.calls), "-d", str(body("hot")),
             "-H", "content-type: application/grpc", "-H", "te: trailers",
             f"http://127.0.0.1:{s.grpc}{run.RLS_PATH}"],
            check=True, capture_output=True, text=True).stdout
        return int(re.search(r"(\d+) succeeded", out).group(1))

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


if __name__ == "__main__":
    main()
