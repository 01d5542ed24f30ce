#!/usr/bin/env bash
# Load benchmark of the whole server: release build, a benchmark policy set, ShouldRateLimit
# driven by h2load (a gRPC unary call is a POST of a pre-framed protobuf body), the server
# pinned to core 0 and h2load to core 1. Prints decisions/s and latency p50/p99/p99.9 for each
# scenario and concurrency, checks from the server's own counters that every answer was a real
# decision (no errors; the expected mix of OK and OVER_LIMIT), and runs the same load against
# a transport floor (the same server built to answer OK without deciding).
#
#   benches/load.sh            # needs h2load (Debian: nghttp2-client) and redis-server
#   DURATION=10 benches/load.sh
#   LOADBENCH_BIN=... LOADBENCH_FLOOR_BIN=... benches/load.sh   # prebuilt binaries, no build
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
command -v h2load >/dev/null || { echo "load.sh: needs h2load (apt-get install nghttp2-client)" >&2; exit 1; }
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT

if [ -n "${LOADBENCH_BIN:-}" ] && [ -n "${LOADBENCH_FLOOR_BIN:-}" ]; then
    # Prebuilt: the release binary and one built with --features bench-floor.
    cp "$LOADBENCH_BIN" "$work/sluice"; cp "$LOADBENCH_FLOOR_BIN" "$work/sluice-floor"
else
    echo "== building release binaries (the real server and the transport floor)" >&2
    cargo build --release --locked --quiet --bin sluice
    cp target/release/sluice "$work/sluice"
    cargo build --release --locked --quiet --bin sluice --features bench-floor
    cp target/release/sluice "$work/sluice-floor"
    cargo build --release --locked --quiet --bin sluice   # leave the normal binary in place
fi

mkdir "$work/policies"
cp benches/load/bench.yaml "$work/policies/"

# Pre-framed gRPC bodies: 1 byte uncompressed flag, 4-byte length, a RateLimitRequest.
python3 - "$work" <<'PY'
import struct, sys
def field(n, data): return bytes([n << 3 | 2]) + varint(len(data)) + data
def varint(v):
    out = b""
    while True:
        b = v & 0x7F; v >>= 7
        out += bytes([b | (0x80 if v else 0)])
        if not v: return out
def request(descriptors):
    body = field(1, b"bench")
    for entries in descriptors:
        d = b"".join(field(1, field(1, k.encode()) + field(2, v.encode())) for k, v in entries)
        body += field(2, d)
    return b"\x00" + struct.pack(">I", len(body)) + body
work = sys.argv[1]
open(f"{work}/hot.bin", "wb").write(request([[("hot", "x")]]))
open(f"{work}/one.bin", "wb").write(request([[("d", "0")]]))
open(f"{work}/ten.bin", "wb").write(request([[("d", str(i))] for i in range(10)]))
PY

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
counter() { curl -s "http://127.0.0.1:$1/metrics" | awk -v s="sluice_decisions_total{result=\"$2\"}" '$1==s {print $2+0}' | head -1; }

serve() {  # binary, extra args...; sets GRPC and ADMIN
    local bin=$1; shift
    GRPC=$(port); ADMIN=$(port)
    taskset -c 0 "$bin" serve --policies "$work/policies" --grpc-addr "127.0.0.1:$GRPC" \
        --admin-addr "127.0.0.1:$ADMIN" --log-level error "$@" &
    SERVER=$!
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$ADMIN/healthcheck" >/dev/null && return; sleep 0.1; done
    echo "server did not start" >&2; exit 1
}

stop() { kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; }

load() {  # scenario body clients streams [rps] -> one result line
    local name=$1 body=$2 clients=$3 streams=$4 rps=${5:-}
    local ok0 over0 bad0 log="$work/h2load.log"
    ok0=$(counter "$ADMIN" ok); over0=$(counter "$ADMIN" over_limit)
    bad0=$(( $(counter "$ADMIN" invalid) + $(counter "$ADMIN" backend_error) ))
    rm -f "$log"
    local out
    out=$(taskset -c 1 h2load -c "$clients" -m "$streams" -D "$DURATION" --warm-up-time 1 \
        ${rps:+--rps "$rps"} -d "$body" --log-file "$log" \
        -H 'content-type: application/grpc' -H 'te: trailers' \
        "http://127.0.0.1:$GRPC/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" 2>&1)
    local ok over bad
    ok=$(( $(counter "$ADMIN" ok) - ok0 )); over=$(( $(counter "$ADMIN" over_limit) - over0 ))
    bad=$(( $(counter "$ADMIN" invalid) + $(counter "$ADMIN" backend_error) - bad0 ))
    printf '%s\n' "$out" > "$work/h2load.out"
    python3 - "$log" "$name" "$clients" "$streams" "$ok" "$over" "$bad" "${rps:-max}" "$work/h2load.out" <<'PY'
import sys
log, name, c, m, ok, over, bad, rps, out = sys.argv[1:]
text = open(out).read()
rate = next((l.split(",")[1].split()[0] for l in text.splitlines() if l.startswith("finished in")), "?")
status = [l for l in text.splitlines() if l.startswith("status codes:")]
durations = sorted(int(l.split("\t")[2]) for l in open(log) if l.strip())
def pct(p): return durations[min(len(durations) - 1, int(p * len(durations)))] / 1000
print(f"{name:<10} c={c:<3} m={m:<3} rps/client={rps:<6} {rate:>10} decisions/s   "
      f"p50 {pct(0.5):.3f} ms  p99 {pct(0.99):.3f} ms  p99.9 {pct(0.999):.3f} ms   "
      f"ok {ok} over_limit {over} errors {bad}")
if int(bad) > 0:
    print(f"{'':<10} !! {bad} answers were gRPC errors, not decisions")
PY
}

echo "== transport floor (decode, answer OK, no decision)"
serve "$work/sluice-floor"
for cm in "1 1" "10 10" "50 20"; do load floor "$work/hot.bin" $cm; done
stop

echo "== memory backend, one descriptor on a hot key"
serve "$work/sluice"
for cm in "1 1" "10 10" "50 20"; do load hot "$work/hot.bin" $cm; done
echo "== memory backend, ten descriptors per request"
for cm in "10 10" "50 20"; do load ten "$work/ten.bin" $cm; done
stop

if command -v redis-server >/dev/null; then
    echo "== redis backend (redis-server on core 1 beside h2load), one admitted descriptor: one round trip each"
    RPORT=$(port)
    taskset -c 1 redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$work" >/dev/null &
    sleep 0.5
    # A saturated 2-core machine is slower than production; give Redis 100 ms, not 10.
    SLUICE_REDIS__TIMEOUT_MS=100 serve "$work/sluice" --backend redis --redis-url "redis://127.0.0.1:$RPORT"
    sleep 1
    for cm in "10 10" "50 20"; do load redis "$work/one.bin" $cm; done
    stop
fi
