#!/usr/bin/env bash
# Builds every fuzz target with cargo fuzz (libFuzzer, no sanitizer, so the stable toolchain
# builds it), replays each target's saved crashes (fuzz/regressions/<target>/: each must now
# pass), then fuzzes each target for FUZZ_SECONDS (default 30), one after the other, from the
# committed seeds (fuzz/corpus/<target>/) and the corpus earlier runs on this machine grew
# (fuzz/target/corpus/<target>/, not committed). Prints one status line per target; a crash,
# hang or out-of-memory leaves its input in fuzz/artifacts/<target>/ and fails the script.
#
#   fuzz/run.sh                         every target, 30 s each
#   FUZZ_SECONDS=600 fuzz/run.sh rls_decide
#
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`) and a C++ compiler (libFuzzer is
# built from source). FUZZ_TIMEOUT (default 10) is the seconds one input may take before it
# counts as a hang.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${FUZZ_SECONDS:-30}"
timeout="${FUZZ_TIMEOUT:-10}"
if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    targets=(policy_load rls_decide json_body trace_reader usage_reports)
fi

host="$(rustc -vV | sed -n 's/^host: //p')"
bin="fuzz/target/$host/release"

echo "fuzz: building ${targets[*]}"
build_start=$SECONDS
for t in "${targets[@]}"; do
    cargo fuzz build --sanitizer none "$t"
done
echo "fuzz: built in $((SECONDS - build_start)) s"

# What went wrong, from a libFuzzer log: the input, the panic and its message, the verdict.
explain() {
    # A fuzzing run's log names no input it ran (only a replay's does): no match is no failure.
    { grep -E '^Running: ' "$1" || true; } | tail -n 1
    grep -E -A 1 'panicked at' "$1" || true
    grep -E 'ERROR: libFuzzer|SUMMARY|Test unit written' "$1" || tail -n 30 "$1"
}

failed=0
for t in "${targets[@]}"; do
    # Saved crashes first: libFuzzer runs each file given to it once.
    shopt -s nullglob
    regressions=(fuzz/regressions/"$t"/*)
    shopt -u nullglob
    if [ "${#regressions[@]}" -gt 0 ]; then
        if "$bin/$t" -timeout="$timeout" "${regressions[@]}" >"fuzz/target/$t.regressions.log" 2>&1; then
            echo "fuzz: $t: regressions ok (${#regressions[@]} inputs)"
        else
            echo "fuzz: $t: REGRESSION FAILED (fuzz/target/$t.regressions.log)"
            explain "fuzz/target/$t.regressions.log"
            failed=1
        fi
    fi

    mkdir -p "fuzz/target/corpus/$t" "fuzz/artifacts/$t"
    log="fuzz/target/$t.log"
    start=$SECONDS
    status=ok
    "$bin/$t" -max_total_time="$seconds" -timeout="$timeout" -print_final_stats=1 \
        -artifact_prefix="fuzz/artifacts/$t/" "fuzz/target/corpus/$t" "fuzz/corpus/$t" \
        >"$log" 2>&1 || status=FAILED
    took=$((SECONDS - start))
    execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
    cov="$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -n 1)"
    echo "fuzz: $t: $status in ${took} s, ${execs:-?} execs, ${cov:-no coverage line}"
    if [ "$status" != ok ]; then
        explain "$log"
        failed=1
    fi
done
exit "$failed"
