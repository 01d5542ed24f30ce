#!/usr/bin/env python3
"""Redis-side cost of one decision, in instructions of redis-server counted by callgrind (a figure
that other load on the machine does not move).

Starts redis-server under valgrind, loads each script, warms it up, zeroes the counters, sends
CALLS calls of KEYSN descriptors over random keys (one connection, ten calls in flight), dumps,
and divides by the requests decided. BATCH (gcra_lean.lua only, default 1) puts that many
requests in each call, as coalescing does; the figure is then per request. Every descriptor is
one charge of 1 on a limit of 10 per second with a burst of 10. HOT=1 (gcra_lean.lua only)
sends every request to the same counters instead (one per descriptor), on a limit of 10,000,000
per second so that each is admitted: the usual shared limit of a route, whose requests coalesce
onto one key. minimal.lua is the least a one-key GCRA needs (TIME, GET, SET ... PX, arithmetic on
doubles), for comparison.

    benches/redis/instructions.py src/limiter/redis/gcra_lean.lua src/limiter/redis/gcra.lua \\
        benches/redis/minimal.lua
    KEYSN=10 CALLS=1500 benches/redis/instructions.py src/limiter/redis/gcra_lean.lua
    BATCH=16 CALLS=1000 benches/redis/instructions.py src/limiter/redis/gcra_lean.lua
    HOT=1 BATCH=16 CALLS=1000 benches/redis/instructions.py src/limiter/redis/gcra_lean.lua

Each script gets its own arguments: gcra_lean.lua its binary request list (ARGV[3], little-endian
doubles), gcra.lua and minimal.lua decimal ones. LEAN_ARGS=decimal sends gcra_lean.lua the
decimal arguments it took before they were binary (per request whole, the op count and six per
op), to measure an older build's script:

    git show OLD:src/limiter/redis/gcra_lean.lua > /tmp/old/gcra_lean.lua
    LEAN_ARGS=decimal BATCH=16 CALLS=500 benches/redis/instructions.py /tmp/old/gcra_lean.lua

Needs valgrind and redis-server; no Python package beyond the standard library.
"""

import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
import callgrind  # noqa: E402  (reading the dumps, shared with benches/load)

# T = 0.1 s, B·T = 1 s, B = 10, cost 1, enforce, period 1 s.
OP = (100_000_000, 1_000_000_000, 10, 1, 0, 1_000_000_000)
# HOT=1: T = 100 ns, B·T = 1 s, B = 10,000,000: every charge admitted.
HOT = os.environ.get("HOT") == "1"
if HOT:
    OP = (100, 1_000_000_000, 10_000_000, 1, 0, 1_000_000_000)
IN_FLIGHT = 10


def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def read_reply(f):
    """One RESP reply from the buffered socket `f` (errors raise)."""
    line = f.readline()
    kind, rest = line[:1], line[1:-2]
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind in (b"+", b":"):
        return rest
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:-2]
    if kind == b"*":
        return [read_reply(f) for _ in range(int(rest))]
    raise RuntimeError(f"unexpected reply {line!r}")


def call(script, sha, keysn, batch):
    """One EVALSHA of `script` over fresh random keys."""
    lean = script.name == "gcra_lean.lua"
    requests = batch if lean else 1
    if HOT:
        keys = [f"hot-k{i}" for _ in range(requests) for i in range(keysn)]
    else:
        keys = [f"r{r}-k{i}:{random.randrange(100_000)}" for r in range(requests) for i in range(keysn)]
    if lean and os.environ.get("LEAN_ARGS") == "decimal":
        args = ["", requests] + ([1, keysn] + list(OP) * keysn) * requests
    elif lean:
        blob = b"".join(struct.pack("<2d", 1, keysn) + struct.pack("<6d", *OP) * keysn
                        for _ in range(requests))
        args = ["", requests, blob]
    else:
        args = ["", 1] + list(OP) * keysn
    return resp("EVALSHA", sha, len(keys), *keys, *args)


def drive(conn, f, script, sha, keysn, batch, calls):
    done = 0
    while done < calls:
        n = min(IN_FLIGHT, calls - done)
        conn.sendall(b"".join(call(script, sha, keysn, batch) for _ in range(n)))
        for _ in range(n):
            read_reply(f)
        done += n


def measure(script, keysn, batch, calls):
    work = tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={work}/cg.out", "redis-server",
         "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit("instructions: redis-server did not start under valgrind")
        f = conn.makefile("rb")
        conn.sendall(resp("SCRIPT", "LOAD", script.read_text()))
        sha = read_reply(f).decode()
        drive(conn, f, script, sha, keysn, batch, 200)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        drive(conn, f, script, sha, keysn, batch, calls)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    total = callgrind.total(work, "cg.out")
    shutil.rmtree(work, ignore_errors=True)
    requests = calls * (batch if script.name == "gcra_lean.lua" else 1)
    return total // requests


def main():
    if not sys.argv[1:]:
        sys.exit(__doc__)
    for tool in ("valgrind", "redis-server", "callgrind_annotate"):
        if shutil.which(tool) is None:
            sys.exit(f"instructions: needs {tool} (Debian: valgrind, redis-server)")
    keysn = int(os.environ.get("KEYSN", 1))
    calls = int(os.environ.get("CALLS", 4000))
    batch = int(os.environ.get("BATCH", 1))
    for name in sys.argv[1:]:
        script = Path(name)
        if HOT and script.name != "gcra_lean.lua":
            sys.exit(f"instructions: HOT=1 is for gcra_lean.lua only, not {script.name}")
        per = measure(script, keysn, batch, calls)
        print(f"{script.name:<16} {keysn:2d} descriptors{' (hot)' if HOT else ''}  {per:9,d} instructions/request"
              + (f"  ({batch} a call)" if batch > 1 and script.name == "gcra_lean.lua" else ""))


if __name__ == "__main__":
    main()
