#!/usr/bin/env bash
# Issue 4 scaling run: a synthetic deepseek_v3 model whose routed experts are at least twice the
# RAM budget, laid out on 1, 2, 3, 4 emulated drives (equal blkio read throttles), stripe and
# replicate; `deltafin bench generate` (tokens/s, TTFT, bytes/token, hit rate, prefetch) and
# `deltafin bench io` (our read rate and fio's ceiling on the same files) for each.
# Writes benches/results/gen_scaling.json.
#
#   sudo benches/gen_scaling.sh [--bps 157286400] [--preset medium] [--ram-budget 700M]
#        [--new-tokens 16] [--prompts short] [--repeats 1] [--long-prompt 512]
#        [--arch deepseek_v3|qwen3_moe|kimi_linear|kimi_k3] [--format bf16|mxfp4|...]
#        [--set key=value ...] [--out FILE]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
BPS=$((150 * 1024 * 1024)); PRESET=medium; BUDGET=700M; NEW=16; PROMPTS=short; REPEATS=1
LONG=512; THREADS=4; UNIT=512K; MODES="stripe replicate"; COUNTS="1 2 3 4"
ARCH=deepseek_v3; FORMAT=bf16; SETS=()
while [ $# -gt 0 ]; do
    case $1 in
        --bps) BPS=$2; shift 2 ;;
        --preset) PRESET=$2; shift 2 ;;
        --ram-budget) BUDGET=$2; shift 2 ;;
        --new-tokens) NEW=$2; shift 2 ;;
        --prompts) PROMPTS=$2; shift 2 ;;
        --repeats) REPEATS=$2; shift 2 ;;
        --long-prompt) LONG=$2; shift 2 ;;
        --modes) MODES=$2; shift 2 ;;
        --drives) COUNTS=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --arch) ARCH=$2; shift 2 ;;
        --format) FORMAT=$2; shift 2 ;;
        --set) SETS+=(--set "$2"); shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/gen_scaling.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
model="$work/$PRESET"
if [ "$ARCH" != deepseek_v3 ] || [ "$FORMAT" != bf16 ] || [ ${#SETS[@]} -gt 0 ]; then
    model="$work/$ARCH-$PRESET-$FORMAT-$(echo "${SETS[*]:-}" | md5sum | cut -c1-8)"
fi
if [ ! -f "$model/config.json" ]; then
    "$bin" synth --out "$model" --arch "$ARCH" --preset "$PRESET" --format "$FORMAT" \
        ${SETS[@]+"${SETS[@]}"} --seed 1 --force -q
fi
model_bytes=$(du -sb "$model" | cut -f1)
size_gb=$(( model_bytes / 1000000000 + 2 ))
drives_setup 4 "$size_gb" "$BPS"
out=${OUT:-"$repo/benches/results/gen_scaling.json"}
tmp=$(mktemp -d)
for mode in $MODES; do
    for n in $COUNTS; do
        args=()
        for ((i = 0; i < n; i++)); do args+=(--drive "$BENCH_MNT/d$i"); done
        "$bin" layout --model "$model" "${args[@]}" --mode "$mode" --stripe-unit "$UNIT" --name "g-$mode-$n" --force -q >&2
        drop_caches
        in_throttled "$bin" bench io "$BENCH_MNT/d0/g-$mode-$n" --json --seconds 4 --threads-per-drive "$THREADS" > "$tmp/io-$mode-$n.json"
        drop_caches
        in_throttled "$bin" bench generate "$BENCH_MNT/d0/g-$mode-$n" --json --prompts "$PROMPTS" \
            --new-tokens "$NEW" --repeats "$REPEATS" --long-prompt "$LONG" --ram-budget "$BUDGET" \
            --threads-per-drive "$THREADS" > "$tmp/gen-$mode-$n.json"
        python3 -c 'import json,sys; g=json.load(open(sys.argv[1])); i=json.load(open(sys.argv[2]))
for r in g["rows"]: print("%-9s %d drive(s) %-45s %.2f tok/s  TTFT %.2f s  %.1f MiB/token  io %.3f GB/s fio %.3f GB/s" % (g["mode"], g["drives"], r["prompt"], r["tokens_per_s_median"], r["ttft_s_median"], (r["bytes_read_per_token_median"] or 0)/2**20, i["gb_per_s"], i["fio_gb_per_s"] or 0))' "$tmp/gen-$mode-$n.json" "$tmp/io-$mode-$n.json" >&2
        for ((i = 0; i < n; i++)); do rm -rf "$BENCH_MNT/d$i/g-$mode-$n"; done
    done
done
python3 - "$tmp" "$out" "$BPS" "$PRESET" "$BUDGET" "$model_bytes" "$ARCH" "$FORMAT" "${SETS[*]:-}" <<'PY'
import json, sys, glob, os, datetime
tmp, out, bps, preset, budget, model_bytes, arch, fmt, sets = sys.argv[1:]
rows = []
for f in sorted(glob.glob(os.path.join(tmp, "gen-*.json"))):
    g = json.load(open(f))
    i = json.load(open(f.replace("gen-", "io-")))
    for r in g["rows"]:
        runs = r.pop("runs")
        rows.append({"mode": g["mode"], "drives": g["drives"], **r,
                     "io_gb_per_s": i["gb_per_s"], "fio_gb_per_s": i["fio_gb_per_s"],
                     "expert_bytes_total": runs[0].get("expert_bytes_total"),
                     "ram_budget_bytes": runs[0].get("ram_budget_bytes"),
                     "peak_rss_bytes": r.get("peak_rss_bytes_max"),
                     "machine": g.get("machine"), "run0": runs[0]})
summary = {}
for mode in ("stripe", "replicate"):
    for prompt in sorted({r["prompt"] for r in rows}):
        sel = {r["drives"]: r for r in rows if r["mode"] == mode and r["prompt"] == prompt}
        if 1 in sel and 4 in sel and sel[1]["tokens_per_s_median"]:
            summary.setdefault(mode, {})[prompt] = {
                "tokens_per_s_4_vs_1": sel[4]["tokens_per_s_median"] / sel[1]["tokens_per_s_median"],
                "fio_4_vs_1": (sel[4]["fio_gb_per_s"] or 0) / max(sel[1]["fio_gb_per_s"] or 1e-9, 1e-9)}
doc = {"benchmark": "gen_scaling", "date": datetime.datetime.utcnow().isoformat() + "Z",
       "command": os.environ.get("BENCH_CMD", ""), "throttle_bytes_per_s_per_drive": int(bps),
       "preset": preset, "arch": arch, "format": fmt, "sets": sets,
       "ram_budget": budget, "model_bytes": int(model_bytes),
       "machine": rows[0]["machine"] if rows else None,
       "summary": summary, "rows": rows}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
rm -rf "$tmp"
echo "wrote $out" >&2
