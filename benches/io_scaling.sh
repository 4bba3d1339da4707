#!/usr/bin/env bash
# Issue 2 acceptance run: a synthetic deepseek_v3 model laid out on 1, 2, 3, 4 emulated drives
# (equal blkio read throttles), replicate and stripe; `deltafin bench io` (expert pattern) three
# times each, median GB/s, plus fio on the same files. Writes benches/results/io_scaling.json.
#
#   sudo benches/io_scaling.sh [--bps 157286400] [--preset medium] [--seconds 8] [--runs 3]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
BPS=$((150 * 1024 * 1024)); PRESET=medium; SECONDS_PER_RUN=8; RUNS=3; THREADS=4; UNIT=512K
while [ $# -gt 0 ]; do
    case $1 in
        --bps) BPS=$2; shift 2 ;;
        --preset) PRESET=$2; shift 2 ;;
        --seconds) SECONDS_PER_RUN=$2; shift 2 ;;
        --runs) RUNS=$2; shift 2 ;;
        --threads) THREADS=$2; shift 2 ;;
        --unit) UNIT=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/io_scaling.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
if [ ! -f "$work/$PRESET/config.json" ]; then
    "$bin" synth --out "$work/$PRESET" --preset "$PRESET" --seed 1 --force -q
fi
model_bytes=$(du -sb "$work/$PRESET" | cut -f1)
size_gb=$(( model_bytes / 1000000000 + 2 ))
drives_setup 4 "$size_gb" "$BPS"
out="$repo/benches/results/io_scaling.json"
rows=()
for mode in stripe replicate; do
    for n in 1 2 3 4; do
        args=()
        for ((i = 0; i < n; i++)); do args+=(--drive "$BENCH_MNT/d$i"); done
        "$bin" layout --model "$work/$PRESET" "${args[@]}" --mode "$mode" --stripe-unit "$UNIT" --name "m-$mode-$n" --force -q >&2
        runs=()
        for ((r = 0; r < RUNS; r++)); do
            drop_caches
            runs+=("$(in_throttled "$bin" bench io "$BENCH_MNT/d0/m-$mode-$n" --json --seconds "$SECONDS_PER_RUN" --threads-per-drive "$THREADS" --seed $((r + 1)))")
        done
        row=$(printf '%s\n' "${runs[@]}" | python3 -c '
import json, sys, statistics
runs = [json.loads(l) for l in sys.stdin if l.strip()]
med = lambda k: statistics.median(r[k] for r in runs if r.get(k) is not None)
first = runs[0]
print(json.dumps({"mode": first["mode"], "drives": first["drives"], "gb_per_s_median": med("gb_per_s"),
  "fio_gb_per_s_median": med("fio_gb_per_s"), "ratio_vs_fio_median": med("ratio_vs_fio"),
  "records_per_s_median": med("records_per_s"), "record_bytes": first["record_bytes"], "k": first["k"],
  "runs": runs}))')
        echo "$row" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("%-9s %d drive(s): %.3f GB/s  fio %.3f GB/s  ours/fio %.2f" % (r["mode"], r["drives"], r["gb_per_s_median"], r["fio_gb_per_s_median"], r["ratio_vs_fio_median"]))' >&2
        rows+=("$row")
        rm -rf "${args[@]/--drive/}" 2>/dev/null || true
        for ((i = 0; i < n; i++)); do rm -rf "$BENCH_MNT/d$i/m-$mode-$n"; done
    done
done
printf '%s\n' "${rows[@]}" | python3 -c '
import json, sys, platform, datetime
rows = [json.loads(l) for l in sys.stdin if l.strip()]
def g(mode, n): return next(r for r in rows if r["mode"] == mode and r["drives"] == n)
summary = {m: {"scaling_4_vs_1": g(m, 4)["gb_per_s_median"] / g(m, 1)["gb_per_s_median"],
               "ratio_vs_fio_4_drives": g(m, 4)["ratio_vs_fio_median"]} for m in ("stripe", "replicate")}
doc = {"benchmark": "io_scaling", "date": datetime.datetime.utcnow().isoformat() + "Z",
       "command": __import__("os").environ.get("BENCH_CMD", ""), "throttle_bytes_per_s_per_drive": int(sys.argv[1]),
       "preset": sys.argv[2], "summary": summary, "rows": rows}
json.dump(doc, open(sys.argv[3], "w"), indent=1)
print(json.dumps(summary, indent=1))
' "$BPS" "$PRESET" "$out"
echo "wrote $out" >&2
