#!/usr/bin/env bash
# Issue 4 measurements beside gen_scaling.sh, on 4 emulated drives (stripe, equal throttles):
#  - compute baselines: the same prompts on the model directory with its pages in RAM (every
#    expert "cached"): prefill time for a 512-token prompt and decode time per token;
#  - TTFT of the 512-token prompt over the layout under the RAM budget, against the time to read
#    every routed expert once at fio's bandwidth;
#  - expert cache policy (lfu vs lru) and next-layer prefetch on/off: tokens/s, hit rate, I/O stall.
# Writes benches/results/gen_extras.json.   sudo benches/gen_extras.sh [--bps B] [--ram-budget 700M]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
ORIG_ARGS="$*"; BPS=$((150 * 1024 * 1024)); PRESET=medium; BUDGET=700M; NEW=32
while [ $# -gt 0 ]; do
    case $1 in --bps) BPS=$2; shift 2 ;; --ram-budget) BUDGET=$2; shift 2 ;; --new-tokens) NEW=$2; shift 2 ;; *) echo "unknown $1" >&2; exit 2 ;; esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/gen_extras.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
[ -f "$work/$PRESET/config.json" ] || "$bin" synth --out "$work/$PRESET" --preset "$PRESET" --seed 1 --force -q
vocab=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$work/$PRESET/config.json")
long=$(python3 -c 'import sys; v=int(sys.argv[1]); print(",".join(str((i * 7919 + 13) % (v - 2) + 2) for i in range(512)))' "$vocab")
short="11,523,77,2048,9,311"
tmp=$(mktemp -d)
# Compute baselines: model directory, pages warmed by a first run.
"$bin" generate --model "$work/$PRESET" --prompt-ids "$long" -n 2 --ignore-eos --json -q > /dev/null
"$bin" generate --model "$work/$PRESET" --prompt-ids "$long" -n "$NEW" --ignore-eos --json -q | tail -1 > "$tmp/ram-long.json"
"$bin" generate --model "$work/$PRESET" --prompt-ids "$short" -n "$NEW" --ignore-eos --json -q | tail -1 > "$tmp/ram-short.json"
model_bytes=$(du -sb "$work/$PRESET" | cut -f1)
drives_setup 4 $(( model_bytes / 1000000000 + 2 )) "$BPS"
args=(); for i in 0 1 2 3; do args+=(--drive "$BENCH_MNT/d$i"); done
"$bin" layout --model "$work/$PRESET" "${args[@]}" --mode stripe --name x --force -q >&2
L="$BENCH_MNT/d0/x"
drop_caches; in_throttled "$bin" bench io "$L" --json --seconds 4 > "$tmp/io.json"
drop_caches; in_throttled "$bin" generate --model "$L" --prompt-ids "$long" -n "$NEW" --ignore-eos --ram-budget "$BUDGET" --json -q | tail -1 > "$tmp/layout-long.json"
for policy in lfu lru; do
    for pf in on off; do
        flag=(); [ $pf = off ] && flag=(--no-prefetch)
        drop_caches
        in_throttled "$bin" generate --model "$L" --prompt-ids "$short" -n "$NEW" --ignore-eos --ram-budget "$BUDGET" --cache-policy $policy "${flag[@]}" --json -q | tail -1 > "$tmp/layout-$policy-$pf.json"
    done
done
python3 - "$tmp" "$repo/benches/results/gen_extras.json" "$BPS" "$BUDGET" <<'PY'
import json, sys, os, glob, datetime
tmp, out, bps, budget = sys.argv[1:]
J = lambda n: json.load(open(os.path.join(tmp, n)))
io, rl, rs, ll = J("io.json"), J("ram-long.json"), J("ram-short.json"), J("layout-long.json")
fio = io["fio_gb_per_s"] * 1e9
experts_total = ll.get("expert_bytes_total") or 0
read_all_s = experts_total / fio if experts_total else None
runs = {f"{p}-{pf}": J(f"layout-{p}-{pf}.json") for p in ("lfu", "lru") for pf in ("on", "off")}
def decode_s(r): return 1.0 / r["tokens_per_s"] if r.get("tokens_per_s") else None
base = runs["lfu-on"]
io_time = base["bytes_read_per_token"] / fio if base.get("bytes_read_per_token") else None
compute = decode_s(rs)
summary = {
  "fio_gb_per_s": fio / 1e9,
  "decode_s_per_token_layout": decode_s(base),
  "decode_io_time_s_per_token": io_time,
  "decode_compute_s_per_token_all_cached": compute,
  "decode_ratio_vs_max_io_compute": decode_s(base) / max(io_time or 0, compute or 0) if base.get("tokens_per_s") else None,
  "ttft_512_layout_s": ll["ttft_s"],
  "read_every_expert_once_s": read_all_s,
  "prefill_512_compute_s_all_cached": rl["ttft_s"],
  "ttft_ratio_vs_max_read_compute": ll["ttft_s"] / max(read_all_s or 0, rl["ttft_s"]),
  "peak_rss_bytes": {k: v.get("peak_rss_bytes") for k, v in runs.items()},
  "ram_budget": budget,
  "policies": {k: {"tokens_per_s": v.get("tokens_per_s"), "expert_cache_hit_rate": v.get("expert_cache_hit_rate"),
                   "prefetch_recall": v.get("prefetch_recall"), "prefetch_precision": v.get("prefetch_precision"),
                   "io_stall_s": v.get("io_stall_s"), "bytes_read_per_token": v.get("bytes_read_per_token")} for k, v in runs.items()},
}
doc = {"benchmark": "gen_extras", "date": datetime.datetime.utcnow().isoformat() + "Z", "command": os.environ.get("BENCH_CMD", ""),
       "throttle_bytes_per_s_per_drive": int(bps), "summary": summary,
       "raw": {"io": io, "ram_long": rl, "ram_short": rs, "layout_long": ll, **runs}}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
rm -rf "$tmp"
