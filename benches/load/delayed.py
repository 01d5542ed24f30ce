#!/usr/bin/env python3
"""What answers held for their slot (a rule's `delay`) cost one node: its resident set and CPU
while HELD calls are held, the p99 of other calls (the `bench` domain, paced by loadgen) with
and without them (twice without, for the spread between two probes), and how long a SIGTERM
takes to answer them all and exit.

The held calls come from loadgen too: C connections of HELD / C streams each, on one counter of
100 a second with a burst of 1 and a delay of 60 s, so each call waits for a slot up to 50 s
ahead and is sent again when answered. A probe beside them starts 2 s after they are held. The server is pinned to core 0 and the generators to
core 1, as the load benchmark runs them.

    python3 benches/load/delayed.py BIN LOADGEN [HELD]    # e.g. target/release/sluice ... 5000

With --redis, the node counts in a redis-server the script starts on a free loopback port (on
core 1, beside the generators): each held call's slot is claimed on the shared TAT by the exact
script, and the figures add Redis's round trips and the CPU redis-server spent. The held calls
open all at once, 5,000 of them in the first few milliseconds, past the 1,024 requests that may
queue for Redis and the default 10 ms `redis.timeout_ms`: the node runs with 1,000 ms, and a
call refused at the queue is sent again by the generator.

    python3 benches/load/delayed.py --redis BIN LOADGEN [HELD]

With --leased as well, the node leases hot counters (`redis.lease.enabled`), so the held
counter is answered from its lease where the lease has the slot, and the figures say how many
decisions the leases answered.

    python3 benches/load/delayed.py --redis --leased BIN LOADGEN [HELD]

With --rounds N, the probes alternate N times, one without holds and one beside them, each
round's held calls on a counter of their own and sent away (their holds cancelled) once probed
beside; every other round probes beside the holds first, so that a probe's place in its round
does not read as the holds' cost (the medians of both kinds of round are printed). The p99
beside the holds is read as the median of its N probes against the median of the N without,
and the spread of those N is printed beside it. Each
round's ratio (beside over without) is printed too, with their median and a 90% bootstrap
interval of that median: the ratio within 10 % is shown when the whole interval is.
--probe-seconds S makes each probe S seconds (10 by default; the held calls are sent for 60 s,
so S + the wait for them to be held + 5 must stay under that).

    python3 benches/load/delayed.py --rounds 5 [--probe-seconds 30] BIN LOADGEN [HELD]

With --pool, the saved outputs of several --rounds runs are read together: each run's median
ratio, and the median of all their rounds with a 90% interval that draws runs again, then rounds
within them, so that the machine's drift between runs counts in it.

    python3 benches/load/delayed.py --pool RUN1.txt RUN2.txt ...
"""

import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import run  # noqa: E402  (the load benchmark's helpers)

HELD_POLICY = """domain: held
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 100, burst: 1, delay: 60s}
"""


# Seconds between the held calls being in place and the probe beside them.
SETTLE = 2


def rss_kib(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def held_now(admin):
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5).read().decode()
    m = re.search(r"^sluice_held_requests (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def loadgen(binary, grpc, *args):
    cmd = ["taskset", "-c", "1", binary, "--addr", f"127.0.0.1:{grpc}", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def probe(binary, grpc, seconds=10):
    """Other calls: 2,000 a second over 8 streams for `seconds`, two descriptors over 1,000 keys."""
    p = loadgen(binary, grpc, "-c", "2", "-m", "4", "--rate", "2000", "-D", str(seconds),
                "--keys", "1000", "--domain", "bench")
    out, _ = p.communicate(timeout=seconds + 50)
    return dict(kv.split("=") for kv in out.split())


def redis_server(work):
    """A redis-server on a free loopback port, on the generators' core."""
    port = run.free_port()
    proc = subprocess.Popen(["taskset", "-c", "1", "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", work],
                            stdout=subprocess.DEVNULL)
    for _ in range(50):
        if subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True,
                          text=True).stdout.strip() == "PONG":
            return proc, port
        time.sleep(0.1)
    sys.exit("delayed: redis-server did not start")


def redis_figures(port):
    """Redis's commands processed and CPU seconds (user and system) so far."""
    info = subprocess.run(["redis-cli", "-p", str(port), "INFO"], capture_output=True,
                          text=True, check=True).stdout
    field = lambda name: float(re.search(rf"^{name}:(\S+)", info, re.M).group(1))
    return field("total_commands_processed"), field("used_cpu_sys") + field("used_cpu_user")


def number(args, flag, default):
    """The whole number after `flag` in `args`, both taken out of them; `default` without it."""
    if flag not in args:
        return default
    at = args.index(flag)
    value = int(args[at + 1])
    del args[at:at + 2]
    return value


def main():
    args = sys.argv[1:]
    if args[:1] == ["--pool"]:
        return pool(args[1:])
    redis, leased = "--redis" in args, "--leased" in args
    rounds, seconds = number(args, "--rounds", 1), number(args, "--probe-seconds", 10)
    args = [a for a in args if a not in ("--redis", "--leased")]
    binary, gen = args[0], args[1]
    held = int(args[2]) if len(args) > 2 else 5000
    conns = 10
    policies = tempfile.mkdtemp()
    if redis:
        redis_proc, port = redis_server(policies)
        extra = ["--backend", "redis", "--redis-url", f"redis://127.0.0.1:{port}"]
    else:
        redis_proc, extra = None, []
    env = {"SLUICE_REDIS__TIMEOUT_MS": "1000"} if redis else {}
    if redis and leased:
        env["SLUICE_REDIS__LEASE__ENABLED"] = "true"
    try:
        measure(binary, gen, (held, conns, rounds, seconds), policies, (extra, env),
                port if redis else None)
    finally:
        if redis_proc:
            redis_proc.terminate()
            redis_proc.wait()


def hold(gen, server, held, conns, round_):
    """HELD calls on the held counter of `round_`, once they are held (or after 30 s)."""
    holder = loadgen(gen, server.grpc, "-c", str(conns), "-m", str(held // conns), "-D", "60",
                     "--warm-up", "0", "--keys", "1", "--key-offset", str(round_),
                     "--descriptors", "1", "--domain", "held")
    deadline = time.time() + 30
    while held_now(server.admin) < held * 0.98 and time.time() < deadline:
        time.sleep(0.2)
    # The probe reads the calls beside answers that are held, not beside the burst that
    # brought them in.
    time.sleep(SETTLE)
    return holder


def alternate(gen, server, load):
    """`rounds` probes without holds and beside them, in turn; the last round's holds kept."""
    held, conns, rounds, seconds = load
    without, beside, first = [], [], []

    def release(holder):
        holder.terminate()
        holder.communicate(timeout=70)
        deadline = time.time() + 30
        while held_now(server.admin) > 0 and time.time() < deadline:
            time.sleep(0.2)

    for r in range(rounds):
        # Every other round probes beside the holds first (the last one never, so that its
        # holds are kept): a difference that comes from a probe's place in its round, not from
        # the holds, reads the other way in those rounds.
        beside_first = r % 2 == 1 and r + 1 < rounds
        if beside_first:
            holder = hold(gen, server, held, conns, r)
            count = held_now(server.admin)
            with_holds = probe(gen, server.grpc, seconds)
            release(holder)
            base = probe(gen, server.grpc, seconds)
        else:
            base = probe(gen, server.grpc, seconds)
            holder = hold(gen, server, held, conns, r)
            count = held_now(server.admin)
            with_holds = probe(gen, server.grpc, seconds)
            if r + 1 < rounds:
                release(holder)
        without.append(float(base["p99_ms"]))
        beside.append(float(with_holds["p99_ms"]))
        first.append(beside_first)
        print(f"round {r + 1}{' (beside first)' if beside_first else ''}: p99_ms "
              f"without={base['p99_ms']} beside {count:.0f} held={with_holds['p99_ms']}; "
              f"p50_ms {base['p50_ms']}, {with_holds['p50_ms']}")
    a, b = statistics.median(without), statistics.median(beside)
    print(f"p99 over {rounds} rounds: median without {a:.3f} ms (from {min(without):.3f} to "
          f"{max(without):.3f}), beside the holds {b:.3f} ms (from {min(beside):.3f} to "
          f"{max(beside):.3f}): {b / a:.2f}x")
    ratios = [y / x for x, y in zip(without, beside)]
    low, high = median_interval(ratios)
    print(f"p99 beside / without, paired by round: median {statistics.median(ratios):.3f}x, "
          f"90% interval of that median {low:.3f}x to {high:.3f}x "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    for label, order in (("without first", False), ("beside first", True)):
        some = [q for q, f in zip(ratios, first) if f == order]
        if some:
            print(f"  rounds probing {label}: {len(some)}, median {statistics.median(some):.3f}x")
    return holder


def pool(files, draws=10_000, seed=1):
    """The paired ratios of saved --rounds runs (their outputs, FILE...), read together: each
    run's median, and the median of all their rounds with a 90% interval from a bootstrap that
    draws runs, then rounds within each drawn run, so that the machine's moves between runs
    widen it as they should."""
    runs = []
    for f in files:
        found = re.search(r"paired by round: .*\(rounds: ([^)]*)\)", Path(f).read_text())
        if not found:
            sys.exit(f"delayed: {f} holds no paired rounds (the output of a --rounds run)")
        runs.append([float(r) for r in found.group(1).split(", ")])
        print(f"{f}: {len(runs[-1])} rounds, median {statistics.median(runs[-1]):.3f}x")
    if not runs:
        sys.exit("delayed: --pool needs the saved outputs of --rounds runs")
    pick = random.Random(seed)
    medians = sorted(
        statistics.median([r for run_ in pick.choices(runs, k=len(runs))
                           for r in pick.choices(run_, k=len(run_))])
        for _ in range(draws))
    every = [r for run_ in runs for r in run_]
    print(f"pooled: {len(every)} rounds of {len(runs)} runs, "
          f"median {statistics.median(every):.3f}x, "
          f"90% interval of that median (runs drawn, then their rounds) "
          f"{medians[draws // 20]:.3f}x to {medians[draws - 1 - draws // 20]:.3f}x")


def median_interval(values, draws=10_000, seed=1):
    """The 5th and 95th percentiles of the median of `values` resampled with replacement
    (a bootstrap): where the median of another run of as many rounds would likely fall."""
    pick = random.Random(seed)
    medians = sorted(statistics.median(pick.choices(values, k=len(values)))
                     for _ in range(draws))
    return medians[draws // 20], medians[draws - 1 - draws // 20]


def measure(binary, gen, load, policies, server_args, redis_port):
    held, conns, rounds, _ = load
    extra, lease_env = server_args
    bench = Path(__file__).parent / "bench.yaml"
    Path(policies, "bench.yaml").write_text(bench.read_text())
    Path(policies, "held.yaml").write_text(HELD_POLICY)
    env = {"SLUICE_GRPC__REQUEST_TIMEOUT_MS": "70000", "SLUICE_GRPC__IDLE_TIMEOUT_MS": "120000",
           **lease_env}
    with run.serving(binary, policies, extra, env=env) as server:
        pid = server.proc.pid
        time.sleep(0.5)
        rss_idle = rss_kib(pid)
        if rounds > 1:
            holder = alternate(gen, server, load)
            measure_held(server, holder, redis_port)
            return
        # Twice without holds: the spread of two probes with nothing changed beside them is
        # what a difference with holds is read against.
        for label in ("without holds", "without holds, again"):
            base = probe(gen, server.grpc)
            print(f"{label}: p50_ms={base['p50_ms']} p99_ms={base['p99_ms']} "
                  f"rate={base['rate']} rss_kib={rss_kib(pid)} (idle {rss_idle})")
        holder = hold(gen, server, held, conns, 0)
        cpu0, t0 = run.cpu_seconds(server.proc), time.time()
        with_holds = probe(gen, server.grpc)
        cpu = (run.cpu_seconds(server.proc) - cpu0) / (time.time() - t0)
        print(f"with {held_now(server.admin):.0f} held: p50_ms={with_holds['p50_ms']} "
              f"p99_ms={with_holds['p99_ms']} rate={with_holds['rate']} "
              f"rss_kib={rss_kib(pid)} cpu={cpu * 100:.1f}% of a core")
        measure_held(server, holder, redis_port)


def measure_held(server, holder, redis_port):
    """The held calls' CPU alone, their Redis figures, and the drain at SIGTERM."""
    pid = server.proc.pid
    # Held calls alone, no other traffic: the CPU the timers and re-sent calls take.
    cpu0, t0 = run.cpu_seconds(server.proc), time.time()
    decided0 = run.metrics(server.admin)
    redis0 = redis_figures(redis_port) if redis_port else None
    time.sleep(5)
    idle_cpu = (run.cpu_seconds(server.proc) - cpu0) / (time.time() - t0)
    print(f"held alone: {held_now(server.admin):.0f} held, cpu={idle_cpu * 100:.1f}% "
          f"of a core, rss_kib={rss_kib(pid)}")
    if redis0:
        decided1, redis1 = run.metrics(server.admin), redis_figures(redis_port)
        calls = sum(decided1.get(k, 0) - decided0.get(k, 0) for k in ("ok", "over_limit"))
        trips = decided1.get("sluice_redis_round_trips_total", 0) - decided0.get(
            "sluice_redis_round_trips_total", 0)
        commands, redis_cpu = redis1[0] - redis0[0], redis1[1] - redis0[1]
        by = {k: decided1.get(k, 0) - decided0.get(k, 0) for k in ("by_lease", "by_redis")}
        print(f"held alone, Redis: {calls:.0f} decisions in 5 s, {trips:.0f} round trips, "
              f"{commands:.0f} commands, redis-server cpu {redis_cpu * 1e6 / max(calls, 1):.1f} "
              f"us per decision; by lease {by['by_lease']:.0f}, by Redis {by['by_redis']:.0f}")
    before = held_now(server.admin)
    refused = run.metrics(server.admin).get("over_limit", 0)
    print(f"refused before the SIGTERM: {refused:.0f} (the probe's bench domain included)")
    t0 = time.time()
    server.proc.terminate()
    code = server.proc.wait(timeout=30)
    print(f"SIGTERM with {before:.0f} held: exited {code} after {time.time() - t0:.3f} s")
    out, _ = holder.communicate(timeout=70)
    print(f"holder: {out.strip()}")


if __name__ == "__main__":
    main()
