#!/usr/bin/env bash
# Issue 16: `deltafin plan`'s predicted decode tokens/s against the measured one, on the
# k3-width synth (Kimi K3's widths, MXFP4 experts) laid out striped over 1, 2 and 4 emulated
# drives (blkio-throttled loop devices), at three RAM sizes. For each: plan --ram R with one
# --drive-bw per drive at the throttle, then `generate` with the --ram-budget the plan gives
# the runtime (R less its reserve); the plan predicts the average decode time per token over
# the run's decoded tokens after its 8-token prompt from a cold expert cache (--tokens,
# --warm-prompt), as the run measures it. The routing the plan assumes was recorded once, in
# RAM, on another prompt (`generate --save-routing`, 64 tokens; `plan --routing`); with
# --uniform the plan assumes uniform routing instead.
#
# The drives: the blkio throttle credits a drive's idle time (up to its 100 ms slice) to the
# next read, which a real drive does not (16 MiB reads after 20 ms pauses ran at twice the
# throttle here), so a run that leaves the drive idle while it computes would look faster
# than on a real drive of that rate. The runs therefore also pace each drive's reads in the
# process at the throttle (`generate --pace-drives`, no idle credit); --no-pace leaves only
# the blkio throttle. Each point is --rounds (plan, run) pairs back to back, and compared by
# their medians: this machine's speed drifts by a third within minutes. Writes
# benches/results/plan_accuracy${OUT_SUFFIX}.json.
#
#   sudo benches/plan_accuracy.sh [--bps 419430400] [--rams 7.5G,8.5G,10G] [--drives 1,2,4]
#        [--new-tokens 32] [--rounds 3] [--uniform] [--no-pace]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
BPS=$((400 * 1024 * 1024)); RAMS=7.5G,8.5G,10G; COUNTS=1,2,4; NEW=32; UNIFORM=0; ROUNDS=3; PACE=1
while [ $# -gt 0 ]; do
    case $1 in
        --bps) BPS=$2; shift 2 ;;
        --rams) RAMS=$2; shift 2 ;;
        --drives) COUNTS=$2; shift 2 ;;
        --new-tokens) NEW=$2; shift 2 ;;
        --uniform) UNIFORM=1; shift ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --no-pace) PACE=0; shift ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/plan_accuracy.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
model=${BENCH_WORK:-/var/tmp/deltafin-bench-model}/k3-width-mxfp4
[ -f "$model/config.json" ] || "$bin" synth --out "$model" --arch kimi_k3 --preset k3-width --format mxfp4 --force -q
# The routing the plan assumes: recorded in RAM on a prompt the measured runs do not use.
routing=$(mktemp --suffix .json)
calib=$(python3 -c "print(','.join(str(11 + 977 * i % 30000) for i in range(8)))")
"$bin" generate --model "$model" --prompt-ids "$calib" -n 64 --ignore-eos -q \
    --save-routing "$routing" > /dev/null
plan_routing=(--routing "$routing")
[ "$UNIFORM" = 1 ] && plan_routing=()
pace=(--pace-drives "$BPS")
[ "$PACE" = 0 ] && pace=()
IFS=, read -r -a counts <<< "$COUNTS"
IFS=, read -r -a rams <<< "$RAMS"
max=0; for n in "${counts[@]}"; do [ "$n" -gt "$max" ] && max=$n; done
drives_setup "$max" 10 "$BPS"
raw=$(mktemp)
prompt=$(python3 -c "print(','.join(str(7 + 131 * i % 30000) for i in range(8)))")
for n in "${counts[@]}"; do
    args=(); bws=()
    for ((i = 0; i < n; i++)); do args+=(--drive "$BENCH_MNT/d$i"); bws+=(--drive-bw "$BPS"); done
    "$bin" layout --model "$model" "${args[@]}" --mode stripe --name k3w --force -q >&2
    for ram in "${rams[@]}"; do
      for ((round = 0; round < ROUNDS; round++)); do
        # The run's length from a cold cache: the prompt and every generated token.
        "$bin" plan --model "$BENCH_MNT/d0/k3w" --ram "$ram" "${bws[@]}" --tokens "$NEW" --context $((NEW + 8)) \
            --warm-prompt 8 "${plan_routing[@]}" --json > "$raw.plan"
        budget=$(python3 -c "import json; print(json.load(open('$raw.plan'))['ram_budget_bytes'])")
        drop_caches
        in_throttled "$bin" generate --model "$BENCH_MNT/d0/k3w" --prompt-ids "$prompt" -n "$NEW" \
            --ignore-eos --ram-budget "$budget" "${pace[@]}" --json -q 2>/dev/null | tail -1 > "$raw.gen"
        python3 - "$raw.plan" "$raw.gen" "$n" "$ram" "$round" >> "$raw" <<'PY'
import json, sys
p, g = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
measured = 1.0 / g["decode_s_per_token"]
print(json.dumps({"drives": int(sys.argv[3]), "ram": sys.argv[4], "round": int(sys.argv[5]),
    "ram_budget_bytes": p["ram_budget_bytes"],
    "predicted_tokens_per_s": p["tokens_per_s"], "measured_tokens_per_s": measured,
    "error": p["tokens_per_s"] / measured - 1.0,
    "predicted_hit_rate": p["hit_rate"], "measured_hit_rate": g.get("decode_expert_cache_hit_rate"),
    "hit_rate_assumed": p["hit_rate_assumed"],
    "measured_decode_s_per_token": g["decode_s_per_token"],
    "predicted_read_bytes_per_token": p["read_bytes_per_token"], "measured_read_bytes_per_token": g.get("bytes_read_per_token"),
    "predicted_io_s": p["decode_io_s"], "predicted_compute_s": p["decode_compute_s"],
    "predicted_critical_path_s": p["decode_critical_path_s"],
    "prefetch_recall": g.get("prefetch_recall"),
    "peak_rss_bytes": g.get("peak_rss_bytes")}))
PY
      done
    done
    # Free the loop images' blocks too (they are sparse files on this machine's one disk).
    for ((i = 0; i < n; i++)); do rm -rf "$BENCH_MNT/d$i/k3w"; fstrim "$BENCH_MNT/d$i" || true; done
done
python3 - "$raw" "$repo/benches/results/plan_accuracy${OUT_SUFFIX:-}.json" "$BPS" "$PACE" <<'PY'
import json, sys, os, datetime, statistics, platform
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
points = {}
for r in rows:
    points.setdefault((r["drives"], r["ram"]), []).append(r)
summary = []
for (d, ram), rs in points.items():
    pred = statistics.median(r["predicted_tokens_per_s"] for r in rs)
    meas = statistics.median(r["measured_tokens_per_s"] for r in rs)
    summary.append({"drives": d, "ram": ram, "rounds": len(rs),
                    "predicted_tokens_per_s_median": pred, "measured_tokens_per_s_median": meas,
                    "error": pred / meas - 1.0,
                    "predicted_hit_rate": statistics.median(r["predicted_hit_rate"] for r in rs),
                    "measured_hit_rate": statistics.median(r["measured_hit_rate"] or 0 for r in rs)})
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
doc = {"benchmark": "plan_accuracy", "date": datetime.datetime.utcnow().isoformat() + "Z",
       "command": os.environ.get("BENCH_CMD", ""), "model": "kimi_k3 k3-width synth, MXFP4 experts",
       "machine": {"cores": os.cpu_count(), "cpu": cpu, "kernel": platform.release()},
       "throttle_bytes_per_s_per_drive": int(sys.argv[3]),
       "paced_in_process": sys.argv[4] == "1",
       "within_20_percent": sum(abs(s["error"]) <= 0.2 for s in summary), "points": len(summary),
       "max_abs_error": max(abs(s["error"]) for s in summary) if summary else None,
       "summary": summary, "rows": rows}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
for s in summary:
    print(f"{s['drives']} drive(s) RAM {s['ram']:>5}: predicted {s['predicted_tokens_per_s_median']:.2f} tok/s, measured {s['measured_tokens_per_s_median']:.2f} ({100*s['error']:+.0f}%); hit rate {s['predicted_hit_rate']:.2f} vs {s['measured_hit_rate']:.2f}")
print(f"{doc['within_20_percent']} of {doc['points']} points within 20%")
PY
rm -f "$raw" "$raw.plan" "$raw.gen" "$routing"
