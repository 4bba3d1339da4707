#!/usr/bin/env bash
# How the engine's defaults were chosen: `bench io` (expert pattern) on a 4-directory stripe
# layout of the medium synthetic model, for stripe units 128K..2M and 1..8 reader threads per
# drive, RUNS runs each (median). Writes benches/results/tuning.json.
#   benches/tune.sh [--runs 3] [--seconds 3]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
ORIG_ARGS="$*"; RUNS=3; SECS=3; PRESET=medium
while [ $# -gt 0 ]; do
    case $1 in --runs) RUNS=$2; shift 2 ;; --seconds) SECS=$2; shift 2 ;; *) echo "unknown $1" >&2; exit 2 ;; esac
done
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
[ -f "$work/$PRESET/config.json" ] || "$bin" synth --out "$work/$PRESET" --preset "$PRESET" --seed 1 --force -q
dirs=$(mktemp -d /var/tmp/deltafin-tune.XXXX)
trap 'rm -rf "$dirs"' EXIT INT TERM
args=(); for i in 0 1 2 3; do mkdir -p "$dirs/d$i"; args+=(--drive "$dirs/d$i"); done
for unit in 128K 256K 512K 1M 2M; do
    "$bin" layout --model "$work/$PRESET" "${args[@]}" --mode stripe --stripe-unit "$unit" --name m --force -q >&2
    for threads in 1 2 4 8; do
        for ((r = 1; r <= RUNS; r++)); do
            sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
            "$bin" bench io "$dirs/d0/m" --json --no-fio --seconds "$SECS" --threads-per-drive "$threads" --seed "$r"
        done
    done
done | BENCH_CMD="benches/tune.sh $ORIG_ARGS" python3 -c '
import json, sys, statistics, os, datetime, collections
runs = [json.loads(l) for l in sys.stdin if l.strip()]
groups = collections.defaultdict(list)
for r in runs: groups[(r["stripe_unit"], r["threads_per_drive"])].append(r["gb_per_s"])
table = [{"stripe_unit": u, "threads_per_drive": t, "gb_per_s_median": statistics.median(v), "gb_per_s": v} for (u, t), v in sorted(groups.items())]
for row in table: print("unit %8d threads %d: %.3f GB/s %s" % (row["stripe_unit"], row["threads_per_drive"], row["gb_per_s_median"], [round(x, 3) for x in row["gb_per_s"]]))
json.dump({"benchmark": "tuning", "date": datetime.datetime.utcnow().isoformat() + "Z", "command": os.environ["BENCH_CMD"],
  "note": "4 plain directories on one virtual disk (host-cached, noisy); expert pattern, medium preset (4.5 MiB records, k=6)",
  "machine": runs[0]["machine"], "table": table}, open(sys.argv[1], "w"), indent=1)
' "$repo/benches/results/tuning.json"
