#!/usr/bin/env python3
"""Redis-side cost of one decision, in instructions of redis-server counted by callgrind (a figure
that other load on the machine does not move).

Starts redis-server under valgrind, loads each script, warms it up, zeroes the counters, sends
CALLS calls of KEYSN descriptors over random keys (one connection, ten calls in flight), dumps,
and divides by the requests decided. Two figures per script: everything the server did, and the
part inside EVALSHA (the script and the commands it calls). The second leaves out the server's
background work (expiry in `serverCron`, paid per second of valgrind's pace, which moves the
first by a few hundred instructions between runs of one script). The keys come from a fixed
seed, so every script of a run meets the same ones. A script is loaded as sluice loads it:
gcra_lean.lua and lease.lua after the `prelude.lua` of their own directory, when there is one.

BATCH (gcra_lean.lua only, default 1) puts that many requests in each call, as coalescing does;
the figure is then per request. Every descriptor is one charge of 1 on a limit of 10 per second
with a burst of 10. HOT=1 (gcra_lean.lua only) sends every request to the same counters instead
(one per descriptor), on a limit of 10,000,000 per second so that each is admitted: the usual
shared limit of a route, whose requests coalesce onto one key. HELD=1 sends every request to the
same counters too, on T = 1 ms with a burst of 10^9, so that each counter always holds a TAT well
ahead and every call reads one (under HOT=1 a lone request's TAT has mostly expired by the next).
lease.lua takes a slice of up to 4 tokens a call, H = 1 s. minimal.lua is the least a one-key
GCRA needs (TIME, GET, SET ... PX, arithmetic on doubles), for comparison.

    benches/redis/instructions.py src/limiter/redis/gcra_lean.lua src/limiter/redis/gcra.lua \\
        benches/redis/minimal.lua
    KEYSN=10 CALLS=1500 benches/redis/instructions.py src/limiter/redis/gcra_lean.lua
    BATCH=16 CALLS=1000 benches/redis/instructions.py src/limiter/redis/gcra_lean.lua
    HOT=1 BATCH=16 CALLS=1000 benches/redis/instructions.py src/limiter/redis/gcra_lean.lua
    HELD=1 CALLS=1500 benches/redis/instructions.py src/limiter/redis/lease.lua

Each script gets its own arguments: gcra_lean.lua its binary request list (ARGV[3], little-endian
doubles), gcra.lua and minimal.lua decimal ones, lease.lua a take (one counter a call).
LEAN_ARGS=decimal sends gcra_lean.lua the decimal arguments it took before they were binary (per
request whole, the op count and six per op), to measure an older build's script:

    git show OLD:src/limiter/redis/gcra_lean.lua > /tmp/old/gcra_lean.lua
    LEAN_ARGS=decimal BATCH=16 CALLS=500 benches/redis/instructions.py /tmp/old/gcra_lean.lua

Needs valgrind and redis-server; no Python package beyond the standard library.
"""

import os
import random
import re
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
# HELD=1: T = 1 ms, B·T = 10^6 s, B = 10^9: every charge admitted, and the TAT always ahead.
HELD = os.environ.get("HELD") == "1"
if HELD:
    OP = (1_000_000, 10**15, 10**9, 1, 0, 1_000_000_000)
IN_FLIGHT = 10
# lease.lua: take up to 4 tokens, reserving up to H = 1 s past the tolerance.
TAKE = (OP[0], OP[1], 4, 1_000_000_000)
# The keys' source, seeded anew for each script.
rng = random.Random()


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


def source(script):
    """The text sluice loads for `script`: gcra_lean.lua and lease.lua after the prelude.lua of
    their directory, when there is one (src/limiter/redis/scripts.rs); any other as it is."""
    prelude = script.parent / "prelude.lua"
    if script.name in ("gcra_lean.lua", "lease.lua") and prelude.exists():
        return prelude.read_text() + script.read_text()
    return script.read_text()


def call(script, sha, keysn, batch):
    """One EVALSHA of `script` over fresh random keys."""
    lean = script.name == "gcra_lean.lua"
    requests = batch if lean else 1
    if HOT or HELD:
        keys = [f"hot-k{i}" for _ in range(requests) for i in range(keysn)]
    else:
        keys = [f"r{r}-k{i}:{rng.randrange(100_000)}" for r in range(requests) for i in range(keysn)]
    if script.name == "lease.lua":
        args = ["", "take", *TAKE]
    elif lean and os.environ.get("LEAN_ARGS") == "decimal":
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
        conn.sendall(resp("SCRIPT", "LOAD", source(script)))
        sha = read_reply(f).decode()
        rng.seed(29)
        drive(conn, f, script, sha, keysn, batch, 200)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        drive(conn, f, script, sha, keysn, batch, calls)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
        conn.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    total, script_part = totals(work, "cg.out")
    shutil.rmtree(work, ignore_errors=True)
    requests = calls * (batch if script.name == "gcra_lean.lua" else 1)
    return total // requests, script_part // requests


def totals(work, prefix):
    """The whole program's instructions in the newest dump, and those inside `evalShaCommand`."""
    dumps = sorted(Path(work).glob(f"{prefix}.*"), key=lambda p: p.stat().st_mtime)
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", str(dumps[-1])],
                          capture_output=True, text=True, check=True).stdout
    total = callgrind.total(work, prefix)
    found = re.search(r"^\s*([\d,]+) \([ \d.]+%\)\s+\S*:evalShaCommand ", text, re.M)
    return total, int(found.group(1).replace(",", ""))


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
        if HOT and HELD:
            sys.exit("instructions: HOT=1 or HELD=1, not both")
        if script.name == "lease.lua" and keysn != 1:
            sys.exit("instructions: lease.lua takes from one counter a call (KEYSN=1)")
        per, in_script = measure(script, keysn, batch, calls)
        how = " (hot)" if HOT else " (held)" if HELD else ""
        print(f"{script.name:<16} {keysn:2d} descriptors{how}  {per:9,d} instructions/request"
              f"  ({in_script:,d} in EVALSHA)"
              + (f"  ({batch} a call)" if batch > 1 and script.name == "gcra_lean.lua" else ""))


if __name__ == "__main__":
    main()
