#!/usr/bin/env bash
# Issue 5: bytes read per token and tokens/s with routed experts quantized at layout time
# (bf16, q8, int4, mxfp4) on 4 emulated drives (stripe, equal throttles), I/O-bound.
# Writes benches/results/quant_scaling.json.   sudo benches/quant_scaling.sh [--bps B] [--ram-budget 700M]
#   --budgets "bf16=700M mxfp4=377M": a RAM budget per format (e.g. the same expert-cache *count*
#   for every format, so that bytes per token show the record-size ratio alone); --out FILE.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
ORIG_ARGS="$*"; BPS=$((150 * 1024 * 1024)); PRESET=medium; BUDGET=700M; NEW=32; FORMATS="bf16 q8 int4 mxfp4"; BUDGETS=""
OUT="$here/results/quant_scaling.json"
while [ $# -gt 0 ]; do
    case $1 in --bps) BPS=$2; shift 2 ;; --ram-budget) BUDGET=$2; shift 2 ;; --new-tokens) NEW=$2; shift 2 ;; --formats) FORMATS=$2; shift 2 ;; --budgets) BUDGETS=$2; shift 2 ;; --out) OUT=$2; shift 2 ;; *) echo "unknown $1" >&2; exit 2 ;; esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/quant_scaling.sh $ORIG_ARGS"
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
tmp=$(mktemp -d)
for f in $FORMATS; do
    q=(); [ "$f" = bf16 ] || q=(--quantize-experts "$f")
    "$bin" layout --model "$work/$PRESET" "${args[@]}" --mode stripe --name "q-$f" --force -q "${q[@]}" >&2
    drop_caches
    budget=$BUDGET
    for fb in $BUDGETS; do [ "${fb%%=*}" = "$f" ] && budget=${fb#*=}; done
    echo "$budget" > "$tmp/$f.budget"
    in_throttled "$bin" bench generate "$BENCH_MNT/d0/q-$f" --json --prompts short --new-tokens "$NEW" --repeats 1 --ram-budget "$budget" > "$tmp/$f.json"
    for i in 0 1 2 3; do rm -rf "$BENCH_MNT/d$i/q-$f"; done
done
python3 - "$tmp" "$OUT" "$BPS" "$BUDGET" $FORMATS <<'PY'
import json, sys, os, datetime
tmp, out, bps, budget, *formats = sys.argv[1:]
rows = {}
for f in formats:
    g = json.load(open(os.path.join(tmp, f + ".json")))
    r = g["rows"]
    rows[f] = {"tokens_per_s_median": sum(x["tokens_per_s_median"] for x in r) / len(r),
               "bytes_read_per_token_median": sum(x["bytes_read_per_token_median"] for x in r) / len(r),
               "expert_cache_hit_rate_median": sum(x["expert_cache_hit_rate_median"] for x in r) / len(r),
               "bytes_per_expert_fetched": sum(x["runs"][0]["expert_bytes"] for x in r) / max(1, sum(x["runs"][0]["experts_fetched"] for x in r)),
               "rows": r}
b = rows.get("bf16")
summary = {f: {"tokens_per_s": v["tokens_per_s_median"], "bytes_per_token": v["bytes_read_per_token_median"],
               "bytes_per_token_ratio_vs_bf16": (b["bytes_read_per_token_median"] / v["bytes_read_per_token_median"]) if b else None,
               "tokens_per_s_ratio_vs_bf16": (v["tokens_per_s_median"] / b["tokens_per_s_median"]) if b else None,
               "hit_rate": v["expert_cache_hit_rate_median"],
               "bytes_per_expert_fetched": v["bytes_per_expert_fetched"],
               "bytes_per_expert_fetched_ratio_vs_bf16": (b["bytes_per_expert_fetched"] / v["bytes_per_expert_fetched"]) if b else None,
               "ram_budget": open(os.path.join(tmp, f + ".budget")).read().strip()} for f, v in rows.items()}
json.dump({"benchmark": "quant_scaling", "date": datetime.datetime.utcnow().isoformat() + "Z", "command": os.environ.get("BENCH_CMD", ""),
           "throttle_bytes_per_s_per_drive": int(bps), "ram_budget": budget, "drives": 4, "mode": "stripe",
           "summary": summary, "rows": rows}, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
rm -rf "$tmp"
