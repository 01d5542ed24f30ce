#!/usr/bin/env bash
# Redis-side cost of one script call, in instructions of redis-server counted by callgrind (a
# figure that other load on the machine does not move): starts redis-server under valgrind, loads
# each script, warms it up, zeroes the counters, sends CALLS calls of KEYSN descriptors over
# random keys with redis-benchmark (10 clients), and divides.
#
#   benches/redis/instructions.sh src/limiter/redis/gcra_lean.lua src/limiter/redis/gcra.lua \
#       benches/redis/minimal.lua
#   KEYSN=10 CALLS=2000 benches/redis/instructions.sh src/limiter/redis/gcra_lean.lua
#   BATCH=16 CALLS=1000 benches/redis/instructions.sh src/limiter/redis/gcra_lean.lua
#
# BATCH (gcra_lean.lua only, default 1) sends that many requests of KEYSN descriptors in each
# call, as coalescing does; the figure is then per request.
# Every call is one charge of 1 on a limit of 10 per second with a burst of 10. minimal.lua is the
# least a one-key GCRA needs (TIME, GET, SET ... PX, arithmetic on doubles), for comparison.
set -euo pipefail
command -v valgrind >/dev/null && command -v redis-benchmark >/dev/null ||
    { echo "needs valgrind and redis-server/redis-tools" >&2; exit 1; }
op1="100000000 1000000000 10 1 0 1000000000"
k=${KEYSN:-1}
n=${CALLS:-4000}
batch=${BATCH:-1}
keys=""
args=""
for i in $(seq 1 "$k"); do keys="$keys k$i:__rand_int__"; args="$args $op1"; done
batch_keys=""
batch_args=""
for r in $(seq 1 "$batch"); do
    for i in $(seq 1 "$k"); do batch_keys="$batch_keys r$r-k$i:__rand_int__"; done
    batch_args="$batch_args 1 $k $args"
done
for script in "$@"; do
    # gcra_lean.lua takes a batch: the request count, then per request whole and its op count.
    case "$(basename "$script")" in
        gcra_lean.lua) call="$((k * batch)) $batch_keys \"\" $batch $batch_args" ;;
        *) call="$k $keys \"\" 1 $args" ;;
    esac
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    dir=$(mktemp -d)
    valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" redis-server --port "$port" \
        --bind 127.0.0.1 --save "" --appendonly no --dir "$dir" >/dev/null 2>&1 &
    pid=$!
    until redis-cli -p "$port" ping >/dev/null 2>&1; do sleep 0.1; done
    sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat "$script")")
    eval "redis-benchmark -p $port -n 200 -c 10 -r 100000 -q EVALSHA $sha $call" >/dev/null
    callgrind_control -z "$pid" >/dev/null
    eval "redis-benchmark -p $port -n $n -c 10 -r 100000 -q EVALSHA $sha $call" >/dev/null
    callgrind_control -d "$pid" >/dev/null
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    dump=$(ls -t "$dir"/cg.out.* | head -1)
    total=$(callgrind_annotate "$dump" 2>/dev/null | grep "PROGRAM TOTALS" | awk '{print $1}' | tr -d ,)
    per=$((total / n))
    [ "$(basename "$script")" = gcra_lean.lua ] && per=$((total / n / batch))
    printf '%-16s %2d descriptors  %9d instructions/request\n' "$(basename "$script")" "$k" "$per"
    rm -rf "$dir"
done
