#!/usr/bin/env python3
"""The server's CPU time and system calls per ShouldRateLimit call, counted by `perf stat` on the
server process over a fixed number of hot-key calls: figures that the machine's other load moves
far less than a rate. Each build runs pinned to core 0, driven by h2load (10 x 10, no log) from
core 1; builds alternate in every round.

    python3 benches/load/syscalls.py [--calls N] [--rounds R] NAME=BIN [NAME=BIN ...]

Needs `perf` (Debian: linux-perf) with the syscalls tracepoints readable, and h2load.
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402  (the load benchmark's helpers)

SYSCALLS = ["writev", "write", "sendmsg", "sendto", "recvfrom", "read", "readv", "epoll_wait",
            "futex", "madvise", "mmap", "munmap"]
EVENTS = ["cpu-clock", "page-faults", "context-switches"] + [f"syscalls:sys_enter_{s}" for s in SYSCALLS]


def measure(binary, policies, body, calls):
    with run.serving(binary, str(policies)) as s:
        perf = subprocess.Popen(["perf", "stat", "-x,", "-e", ",".join(EVENTS), "-p", str(s.proc.pid)],
                                stderr=subprocess.PIPE, text=True)
        out = subprocess.run(
            ["taskset", "-c", "1", "h2load", "-c", "10", "-m", "10", "-n", str(calls), "-d", str(body),
             "-H", "content-type: application/grpc", "-H", "te: trailers",
             f"http://127.0.0.1:{s.grpc}{run.RLS_PATH}"],
            capture_output=True, text=True, check=True).stdout
        perf.send_signal(2)
        counts = perf.communicate()[1]
    answered = int(re.search(r"(\d+) succeeded", out).group(1))
    if answered != calls:
        sys.exit(f"syscalls: {calls - answered} of {calls} calls were not answered")
    rate = float(re.search(r"finished in .*?, ([\d.]+) req/s", out).group(1))
    per = {}
    for line in counts.splitlines():
        f = line.split(",")
        if len(f) > 3 and re.fullmatch(r"[\d.]+", f[0]):
            per[f[2].removeprefix("syscalls:sys_enter_")] = float(f[0]) / answered
    if "cpu-clock" not in per:
        sys.exit(f"syscalls: perf stat counted nothing:\n{counts}")
    return rate, per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("builds", nargs="+", metavar="NAME=BIN")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="sluice-syscalls-")
    policies, body = run.setup(work)
    builds = [spec.split("=", 1) for spec in args.builds]
    for r in range(args.rounds):
        for name, binary in (builds if r % 2 == 0 else builds[::-1]):
            rate, per = measure(binary, policies, body("hot"), args.calls)
            # perf reports cpu-clock in milliseconds.
            figures = "  ".join(f"{k} {v:.3f}" for k, v in per.items() if v >= 0.0005 and k != "cpu-clock")
            print(f"{name:<10} {rate:>9,.0f}/s  CPU {per['cpu-clock'] * 1000:.2f} µs per call"
                  f"  per call: {figures}", flush=True)


if __name__ == "__main__":
    main()
