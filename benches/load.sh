#!/usr/bin/env bash
# Load benchmark of the whole server: builds the release binary, the transport floor (the
# `floor` example: a default tonic server that decodes, answers OK, decides nothing) and the
# many-keys load generator, then runs benches/load/run.py, which pins the server to core 0 and
# the load to core 1, drives ShouldRateLimit with h2load (pre-framed gRPC POSTs) and with the
# generator, checks every run's answers against the server's own counters, and prints
# decisions/s and p50/p99/p99.9.
#
#   benches/load.sh                      # needs h2load (Debian: nghttp2-client); redis-server optional
#   DURATION=10 ROUNDS=5 benches/load.sh
#   LOADBENCH_BIN=... LOADBENCH_FLOOR_BIN=... LOADBENCH_LOADGEN_BIN=... benches/load.sh   # no build
#   COMPARE=/path/to/older/sluice benches/load.sh   # only old against new, alternated in each round
#   LEASED=1 benches/load.sh             # only two leased nodes on one Redis against memory
#   CONTENDED=1 benches/load.sh          # only three nodes sharing one key offered ten times its rate
set -euo pipefail
cd "$(dirname "$0")/.."

command -v h2load >/dev/null || { echo "load.sh: needs h2load (apt-get install nghttp2-client)" >&2; exit 1; }
command -v taskset >/dev/null || { echo "load.sh: needs taskset (util-linux)" >&2; exit 1; }
bins=$(mktemp -d)
trap 'rm -rf "$bins"' EXIT

if [ -n "${LOADBENCH_BIN:-}" ] && [ -n "${LOADBENCH_FLOOR_BIN:-}" ] && [ -n "${LOADBENCH_LOADGEN_BIN:-}" ]; then
    cp "$LOADBENCH_BIN" "$bins/sluice"; cp "$LOADBENCH_FLOOR_BIN" "$bins/sluice-floor"
    cp "$LOADBENCH_LOADGEN_BIN" "$bins/loadgen"
else
    echo "== building release binaries: the server, its transport floor, the load generator" >&2
    cargo build --release --locked --quiet --bin sluice --example floor --example loadgen
    cp target/release/sluice "$bins/sluice"
    cp target/release/examples/floor "$bins/sluice-floor"
    cp target/release/examples/loadgen "$bins/loadgen"
fi

python3 benches/load/run.py --bin "$bins/sluice" --floor "$bins/sluice-floor" --loadgen "$bins/loadgen" \
    ${COMPARE:+--compare "$COMPARE"} ${LEASED:+--leased} ${CONTENDED:+--contended}
