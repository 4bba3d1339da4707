#!/usr/bin/env bash
# Stripe unit and queue depth on 4 emulated drives (equal blkio read throttles, root): `bench io`
# expert pattern for several stripe units (threads 4) and thread counts (unit 512K), RUNS runs
# each, medians into benches/results/unit_sweep.json. With the drives throttled, differences come
# from how evenly the records' units spread over the drives and how well queues stay full.
#   sudo benches/unit_sweep.sh [--bps 157286400] [--runs 3] [--seconds 5]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
ORIG_ARGS="$*"; BPS=$((150 * 1024 * 1024)); RUNS=3; SECS=5; PRESET=medium
while [ $# -gt 0 ]; do
    case $1 in --bps) BPS=$2; shift 2 ;; --runs) RUNS=$2; shift 2 ;; --seconds) SECS=$2; shift 2 ;; *) echo "unknown $1" >&2; exit 2 ;; esac
done
source "$here/emulated_drives.sh"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
[ -f "$work/$PRESET/config.json" ] || "$bin" synth --out "$work/$PRESET" --preset "$PRESET" --seed 1 --force -q
model_bytes=$(du -sb "$work/$PRESET" | cut -f1)
drives_setup 4 $(( model_bytes / 1000000000 + 2 )) "$BPS"
args=(); for i in 0 1 2 3; do args+=(--drive "$BENCH_MNT/d$i"); done
{
for unit in 128K 512K 2M 4M; do
    "$bin" layout --model "$work/$PRESET" "${args[@]}" --mode stripe --stripe-unit "$unit" --name m --force -q >&2
    threads_list="4"; [ "$unit" = 512K ] && threads_list="1 2 4 8"
    for threads in $threads_list; do
        for ((r = 1; r <= RUNS; r++)); do
            drop_caches
            in_throttled "$bin" bench io "$BENCH_MNT/d0/m" --json --no-fio --seconds "$SECS" --threads-per-drive "$threads" --seed "$r"
        done
    done
done
} | BENCH_CMD="benches/unit_sweep.sh $ORIG_ARGS" python3 -c '
import json, sys, statistics, os, datetime, collections
runs = [json.loads(l) for l in sys.stdin if l.strip()]
groups = collections.defaultdict(list)
for r in runs: groups[(r["stripe_unit"], r["threads_per_drive"])].append(r["gb_per_s"])
table = [{"stripe_unit": u, "threads_per_drive": t, "gb_per_s_median": statistics.median(v), "gb_per_s": v} for (u, t), v in sorted(groups.items())]
for row in table: print("unit %8d threads %d: %.3f GB/s %s" % (row["stripe_unit"], row["threads_per_drive"], row["gb_per_s_median"], [round(x, 3) for x in row["gb_per_s"]]))
json.dump({"benchmark": "unit_sweep", "date": datetime.datetime.utcnow().isoformat() + "Z", "command": os.environ["BENCH_CMD"],
  "throttle_bytes_per_s_per_drive": int(sys.argv[2]), "ceiling_gb_per_s": 4 * int(sys.argv[2]) / 1e9,
  "note": "4 emulated drives (loop+ext4, blkio read throttle each); expert pattern, medium preset (4.5 MiB records, k=6)",
  "machine": runs[0]["machine"], "table": table}, open(sys.argv[1], "w"), indent=1)
' "$repo/benches/results/unit_sweep.json" "$BPS"
