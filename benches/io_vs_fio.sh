#!/usr/bin/env bash
# Issue 2 acceptance: `deltafin bench io` on a 4-directory stripe layout (plain directories on
# this machine's disk, no throttle) against fio with the same read size and total queue depth on
# the same files, RUNS times; medians into benches/results/io_vs_fio_4dir.json.
#   benches/io_vs_fio.sh [--preset medium] [--runs 5] [--seconds 5]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
ORIG_ARGS="$*"; PRESET=medium; RUNS=5; SECS=5
while [ $# -gt 0 ]; do
    case $1 in
        --preset) PRESET=$2; shift 2 ;; --runs) RUNS=$2; shift 2 ;; --seconds) SECS=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
[ -f "$work/$PRESET/config.json" ] || "$bin" synth --out "$work/$PRESET" --preset "$PRESET" --seed 1 --force -q
dirs=$(mktemp -d /var/tmp/deltafin-4dir.XXXX)
trap 'rm -rf "$dirs"' EXIT INT TERM
args=(); for i in 0 1 2 3; do mkdir -p "$dirs/d$i"; args+=(--drive "$dirs/d$i"); done
"$bin" layout --model "$work/$PRESET" "${args[@]}" --mode stripe --name m -q >&2
for mode in expert sequential; do
    for ((r = 1; r <= RUNS; r++)); do
        sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
        "$bin" bench io "$dirs/d0/m" --pattern "$mode" --json --seconds "$SECS" --seed "$r"
    done
done | BENCH_CMD="benches/io_vs_fio.sh $ORIG_ARGS" python3 -c '
import json, sys, statistics, os, datetime
runs = [json.loads(l) for l in sys.stdin if l.strip()]
out = {"benchmark": "io_vs_fio_4dir", "date": datetime.datetime.utcnow().isoformat() + "Z", "command": os.environ["BENCH_CMD"], "patterns": {}}
for p in ("expert", "sequential"):
    rs = [r for r in runs if r["pattern"] == p]
    out["patterns"][p] = {"gb_per_s_median": statistics.median(r["gb_per_s"] for r in rs),
        "fio_gb_per_s_median": statistics.median(r["fio_gb_per_s"] for r in rs),
        "ratio_vs_fio_median": statistics.median(r["ratio_vs_fio"] for r in rs),
        "ratios": [round(r["ratio_vs_fio"], 3) for r in rs], "runs": rs}
    print(p, {k: v for k, v in out["patterns"][p].items() if k != "runs"})
json.dump(out, open(sys.argv[1], "w"), indent=1)
' "$repo/benches/results/io_vs_fio_4dir.json"
