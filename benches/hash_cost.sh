#!/usr/bin/env bash
# Issue 13: what verifying every record costs. The medium deepseek_v3 synth striped over 4
# emulated drives (blkio throttle each), `bench generate` alternating --hash-check all and
# --hash-check sampled:16 (the old default) and off, ROUNDS rounds, medians of decode tokens/s.
# Writes benches/results/hash_cost.json.
#
#   sudo benches/hash_cost.sh [--rounds 5] [--new-tokens 32] [--bps 157286400] [--drives 4]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
ROUNDS=5; NEW=32; BPS=$((150 * 1024 * 1024)); N=4; BUDGET=700M; PRESET=medium; MODE=stripe
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --new-tokens) NEW=$2; shift 2 ;;
        --bps) BPS=$2; shift 2 ;;
        --drives) N=$2; shift 2 ;;
        --mode) MODE=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/hash_cost.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
model="$work/$PRESET"
if [ ! -f "$model/config.json" ]; then
    "$bin" synth --out "$model" --preset "$PRESET" --seed 1 --force -q
fi
model_bytes=$(du -sb "$model" | cut -f1)
drives_setup "$N" $(( model_bytes / 1000000000 + 2 )) "$BPS"
args=()
for ((i = 0; i < N; i++)); do args+=(--drive "$BENCH_MNT/d$i"); done
"$bin" layout --model "$model" "${args[@]}" --mode "$MODE" --name hc --force -q >&2
tmp=$(mktemp -d)
for ((r = 0; r < ROUNDS; r++)); do
    for h in all sampled:16 off; do
        drop_caches
        in_throttled "$bin" bench generate "$BENCH_MNT/d0/hc" --json --prompts short \
            --new-tokens "$NEW" --repeats 1 --ram-budget "$BUDGET" --hash-check "$h" \
            > "$tmp/$r-$h.json"
        python3 -c 'import json,sys; g=json.load(open(sys.argv[1]))
print(sys.argv[2], sys.argv[3], " ".join("%.3f" % r["tokens_per_s_median"] for r in g["rows"]))' \
            "$tmp/$r-$h.json" "$r" "$h" >&2
    done
done
python3 - "$tmp" "$ROUNDS" "$repo/benches/results/hash_cost.json" "$N" "$MODE" "$BPS" <<'PY'
import json, os, statistics, sys, platform, datetime
tmp, rounds, out, n, mode, bps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
modes = ["all", "sampled:16", "off"]
runs = {h: [] for h in modes}
for r in range(rounds):
    for h in modes:
        g = json.load(open(os.path.join(tmp, f"{r}-{h}.json")))
        for row in g["rows"]:
            runs[h].append({"round": r, "prompt": row["prompt"],
                            "tokens_per_s": row["tokens_per_s_median"],
                            "decode_s_per_token": row["decode_s_per_token_median"],
                            "bytes_read_per_token": row["bytes_read_per_token_median"]})
med = {h: statistics.median(x["tokens_per_s"] for x in runs[h]) for h in modes}
# Paired per round and prompt: all / sampled:16 in the same round.
pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["all"], runs["sampled:16"])]
pairs_off = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["all"], runs["off"])]
res = {
    "benchmark": "cost of verifying every record (hash-check all) on decode tokens/s",
    "command": os.environ.get("BENCH_CMD", ""),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "machine": {"cpu": platform.processor() or open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
                "cores": os.cpu_count()},
    "drives": n, "mode": mode, "throttle_bytes_per_s_per_drive": bps, "rounds": rounds,
    "tokens_per_s_median": med,
    "all_vs_sampled16_paired_ratio_median": statistics.median(pairs),
    "all_vs_sampled16_paired_ratios": pairs,
    "all_vs_off_paired_ratio_median": statistics.median(pairs_off),
    "cost_vs_sampled16_percent": 100 * (1 - statistics.median(pairs)),
    "cost_vs_off_percent": 100 * (1 - statistics.median(pairs_off)),
    "runs": runs,
}
json.dump(res, open(out, "w"), indent=1)
print(json.dumps({k: res[k] for k in ["tokens_per_s_median", "all_vs_sampled16_paired_ratio_median", "all_vs_off_paired_ratio_median", "cost_vs_sampled16_percent", "cost_vs_off_percent"]}, indent=1))
PY
