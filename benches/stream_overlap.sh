#!/usr/bin/env bash
# Issue 16: decode with streamed non-expert weights on the k3-width synth (Kimi K3's widths,
# MXFP4 experts, 4.5 GiB of non-expert weights) under a RAM budget below that, striped over 1
# and 4 emulated drives (blkio-throttled loop devices). For each drive count, one generation
# with `--ram-budget` (the runtime streams the layers it cannot hold) and, per decoded token:
#   I/O time     = bytes read (streamed layers + missed experts) / (drives x throttle rate)
#   compute time = decode time per token of the same model in RAM (`bench compute`, median)
#   ratio        = decode time per token / max(I/O time, compute time)      (target <= 1.15)
# Also checked: the greedy ids equal the in-RAM model's, and peak RSS stays under the budget.
# The runs pace each drive's reads in the process at the throttle (`generate --pace-drives`):
# the blkio throttle alone credits a drive's idle time to its next read, as a real drive does
# not (see benches/plan_accuracy.sh); --no-pace leaves only the blkio throttle.
# Writes benches/results/stream_overlap${OUT_SUFFIX}.json.
#
#   sudo benches/stream_overlap.sh [--bps 419430400] [--drives 1,4] [--ram 3G] [--new-tokens 8]
#        [--rounds 2] [--no-pace]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
BPS=$((400 * 1024 * 1024)); COUNTS=1,4; RAM=3G; NEW=8; ROUNDS=2; PACE=1
while [ $# -gt 0 ]; do
    case $1 in
        --bps) BPS=$2; shift 2 ;;
        --drives) COUNTS=$2; shift 2 ;;
        --ram) RAM=$2; shift 2 ;;
        --new-tokens) NEW=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --no-pace) PACE=0; shift ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/stream_overlap.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
model=${BENCH_WORK:-/var/tmp/deltafin-bench-model}/k3-width-mxfp4
[ -f "$model/config.json" ] || "$bin" synth --out "$model" --arch kimi_k3 --preset k3-width --format mxfp4 --force -q
pace=(--pace-drives "$BPS")
[ "$PACE" = 0 ] && pace=()
prompt=$(python3 -c "print(','.join(str(7 + 131 * i % 30000) for i in range(8)))")
raw=$(mktemp)

# The in-RAM reference: greedy ids and compute time per decoded token.
"$bin" generate --model "$model" --prompt-ids "$prompt" -n "$NEW" --ignore-eos --json -q \
    2>/dev/null | tail -1 > "$raw.ref"
"$bin" bench compute "$model" --prompt 8 --decode 16 --runs 3 --json 2>/dev/null | tail -1 > "$raw.compute"

IFS=, read -r -a counts <<< "$COUNTS"
max=0; for n in "${counts[@]}"; do [ "$n" -gt "$max" ] && max=$n; done
drives_setup "$max" 12 "$BPS"
for n in "${counts[@]}"; do
    args=()
    for ((i = 0; i < n; i++)); do args+=(--drive "$BENCH_MNT/d$i"); done
    "$bin" layout --model "$model" "${args[@]}" --mode stripe --name k3w --force -q >&2
    for ((r = 0; r < ROUNDS; r++)); do
        drop_caches
        in_throttled "$bin" generate --model "$BENCH_MNT/d0/k3w" --prompt-ids "$prompt" -n "$NEW" \
            --ignore-eos --ram-budget "$RAM" "${pace[@]}" --json -q 2>/dev/null | tail -1 > "$raw.gen"
        python3 - "$raw.gen" "$raw.ref" "$raw.compute" "$n" "$BPS" "$r" >> "$raw" <<'PY'
import json, sys
g, ref, c = (json.load(open(p)) for p in sys.argv[1:4])
n, bps, rnd = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
steps = max(1, g["tokens"] - 1)
stream = g["streamed_layers"]["decode"]
expert_bytes = g["decode_bytes_read"] / steps
stream_bytes = stream["bytes_read"] / steps
io_s = (expert_bytes + stream_bytes) / (n * bps)
compute_s = 1.0 / c["decode_tokens_per_s_median"]
t = g["decode_s_per_token"]
busy = sum(d["busy_s"] for d in g.get("drive_stats", [])) / n / max(1, g["tokens"] + g["prompt_tokens"] / 8)
print(json.dumps({"drives": n, "round": rnd, "ram_budget_bytes": g["ram_budget_bytes"],
    "streamed_layers": g["streamed_layers"]["layers"], "residency": g.get("residency"),
    "decode_s_per_token": t, "io_s_per_token": io_s, "compute_s_per_token": compute_s,
    "ratio": t / max(io_s, compute_s),
    "streamed_bytes_per_token": stream_bytes, "expert_bytes_per_token": expert_bytes,
    "layer_reads_ready": stream["layers_ready"], "layer_reads": stream["layers_read"],
    "stream_wait_s": stream["wait_s"], "expert_hit_rate": g.get("decode_expert_cache_hit_rate"),
    "peak_rss_bytes": g["peak_rss_bytes"], "rss_under_budget": g["peak_rss_bytes"] < g["ram_budget_bytes"],
    "same_ids_as_in_ram": g["token_ids"] == ref["token_ids"]}))
PY
    done
    for ((i = 0; i < n; i++)); do rm -rf "$BENCH_MNT/d$i/k3w"; fstrim "$BENCH_MNT/d$i" || true; done
done
python3 - "$raw" "$raw.compute" "$repo/benches/results/stream_overlap${OUT_SUFFIX:-}.json" "$BPS" "$PACE" <<'PY'
import json, sys, os, datetime, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
c = json.load(open(sys.argv[2]))
by = {}
for r in rows:
    by.setdefault(r["drives"], []).append(r)
summary = {str(n): {"median_ratio": statistics.median(x["ratio"] for x in rs),
                    "median_decode_s_per_token": statistics.median(x["decode_s_per_token"] for x in rs),
                    "io_s_per_token": statistics.median(x["io_s_per_token"] for x in rs),
                    "all_same_ids": all(x["same_ids_as_in_ram"] for x in rs),
                    "all_rss_under_budget": all(x["rss_under_budget"] for x in rs)} for n, rs in by.items()}
doc = {"benchmark": "stream_overlap", "date": datetime.datetime.utcnow().isoformat() + "Z",
       "command": os.environ.get("BENCH_CMD", ""), "model": "kimi_k3 k3-width synth, MXFP4 experts",
       "machine": c.get("machine"), "compute_in_ram": c,
       "throttle_bytes_per_s_per_drive": int(sys.argv[4]), "paced_in_process": sys.argv[5] == "1",
       "target_ratio": 1.15,
       "summary": summary, "rows": rows}
json.dump(doc, open(sys.argv[3], "w"), indent=1)
for r in rows:
    print(f"{r['drives']} drive(s) round {r['round']}: {r['decode_s_per_token']:.3f} s/token, I/O {r['io_s_per_token']:.3f}, "
          f"compute {r['compute_s_per_token']:.3f}: ratio {r['ratio']:.3f}; streamed {r['streamed_layers']}, "
          f"{r['layer_reads_ready']}/{r['layer_reads']} layer reads ready; peak RSS {r['peak_rss_bytes']>>20} MiB "
          f"(budget {r['ram_budget_bytes']>>20}); same ids {r['same_ids_as_in_ram']}")
PY
rm -f "$raw" "$raw.ref" "$raw.compute" "$raw.gen"
