#!/usr/bin/env bash
# Issue 13 soak: TOKENS generated tokens in one run over a streamed layout (the medium
# deepseek_v3 synth with a 16K context, striped over 4 emulated drives, each throttled),
# RSS sampled every second. Reports peak RSS against the RAM budget, and RSS growth after
# warm-up beside what the KV cache alone must add (bytes per position x positions), so a leak
# would show as the difference. Writes benches/results/soak.json and soak.svg.
#
#   sudo benches/soak.sh [--tokens 10000] [--ram-budget 700M] [--bps 157286400]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
TOKENS=10000; BUDGET=700M; BPS=$((150 * 1024 * 1024)); N=4
while [ $# -gt 0 ]; do
    case $1 in
        --tokens) TOKENS=$2; shift 2 ;;
        --ram-budget) BUDGET=$2; shift 2 ;;
        --bps) BPS=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/soak.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
model="$work/medium-ctx16k"
if [ ! -f "$model/config.json" ]; then
    "$bin" synth --out "$model" --preset medium --set max_position_embeddings=16384 --seed 1 \
        --force -q
fi
model_bytes=$(du -sb "$model" | cut -f1)
drives_setup "$N" $(( model_bytes / 1000000000 + 2 )) "$BPS"
args=()
for ((i = 0; i < N; i++)); do args+=(--drive "$BENCH_MNT/d$i"); done
"$bin" layout --model "$model" "${args[@]}" --name soak --force -q >&2
drop_caches
tmp=$(mktemp -d)
in_throttled "$bin" generate --model "$BENCH_MNT/d0/soak" --prompt-ids 1,17,42,99,123,7,256,1024 \
    -n "$TOKENS" --ignore-eos --ram-budget "$BUDGET" --json -q > "$tmp/out.json" 2> "$tmp/err.txt" &
pid=$!
start=$(date +%s.%N)
: > "$tmp/rss.csv"
# The throttled wrapper's child is the generate process.
while kill -0 "$pid" 2>/dev/null; do
    gp=$(pgrep -f "generate --model $BENCH_MNT/d0/soak" | head -1 || true)
    if [ -n "$gp" ] && [ -r "/proc/$gp/status" ]; then
        rss=$(awk '/VmRSS/ {print $2}' "/proc/$gp/status" 2>/dev/null || true)
        [ -n "$rss" ] && echo "$(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN {printf "%.2f", a - b}'),$rss" >> "$tmp/rss.csv"
    fi
    sleep 1
done
wait "$pid"
python3 - "$tmp" "$repo/benches/results" "$BUDGET" "$TOKENS" "$BPS" <<'PY'
import json, os, sys, datetime
tmp, outdir, budget, tokens, bps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
out = json.loads(open(os.path.join(tmp, "out.json")).read().strip().splitlines()[-1])
samples = [tuple(map(float, l.split(","))) for l in open(os.path.join(tmp, "rss.csv")) if "," in l]
t = [s[0] for s in samples]; rss = [s[1] * 1024 for s in samples]
budget_b = out["ram_budget_bytes"]
ttft, rate = out["ttft_s"], out["tokens_per_s"]
b = out.get("budget") or {}
kv_per_pos = (b.get("kv_reserve") or 0) / max(1, out["prompt_tokens"] + tokens)
# Warm-up: the first 10% of decoding (expert cache filling).
decode_start = ttft + out.get("load_s", 0)
warm = decode_start + 0.1 * (t[-1] - decode_start) if t else 0
after = [(ti, r) for ti, r in zip(t, rss) if ti >= warm]
def slope(pts):
    n = len(pts)
    if n < 2: return 0.0
    mx = sum(p[0] for p in pts) / n; my = sum(p[1] for p in pts) / n
    num = sum((p[0] - mx) * (p[1] - my) for p in pts); den = sum((p[0] - mx) ** 2 for p in pts)
    return num / den if den else 0.0
growth_bytes = (after[-1][1] - after[0][1]) if after else 0
positions_added = (after[-1][0] - after[0][0]) * rate if after else 0
kv_expected = positions_added * kv_per_pos
res = {
    "benchmark": "soak: one long generation over a streamed layout, RSS every second",
    "command": os.environ.get("BENCH_CMD", ""),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "drives": 4, "mode": "stripe", "throttle_bytes_per_s_per_drive": bps,
    "tokens": out["tokens"], "tokens_per_s": rate, "ttft_s": ttft,
    "ram_budget_bytes": budget_b, "peak_rss_bytes_sampled": max(rss) if rss else None,
    "peak_rss_bytes_reported": out["peak_rss_bytes"],
    "peak_rss_over_budget": (out["peak_rss_bytes"] > budget_b),
    "budget_split": b,
    "kv_bytes_per_position": kv_per_pos,
    "after_warmup": {"from_s": warm, "rss_start_bytes": after[0][1] if after else None,
                     "rss_end_bytes": after[-1][1] if after else None,
                     "rss_growth_bytes": growth_bytes,
                     "kv_growth_expected_bytes": kv_expected,
                     "growth_beyond_kv_bytes": growth_bytes - kv_expected,
                     "rss_slope_bytes_per_s": slope(after)},
    "bytes_read_per_token": out.get("bytes_read_per_token"),
    "expert_cache_hit_rate": out.get("expert_cache_hit_rate"),
    "repairs": out.get("repairs"), "replica_recoveries": out.get("replica_recoveries"),
    "samples": [[round(a, 2), int(r)] for a, r in zip(t, rss)],
}
json.dump(res, open(os.path.join(outdir, "soak.json"), "w"), indent=1)
# SVG: RSS over time, the budget line, the warm-up mark.
W, H, L, B = 760, 360, 70, 40
tmax = max(t) if t else 1; ymax = max(max(rss or [0]), budget_b) * 1.1
X = lambda v: L + (W - L - 20) * v / tmax
Y = lambda v: H - B - (H - B - 20) * v / ymax
pts = " ".join(f"{X(a):.1f},{Y(r):.1f}" for a, r in zip(t, rss))
ticks = "".join(f'<line x1="{L-4}" x2="{L}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="black"/>'
                f'<text x="{L-8}" y="{Y(v)+4:.1f}" font-size="11" text-anchor="end">{v/2**20:.0f}</text>'
                for v in [ymax * k / 5 for k in range(6)])
xt = "".join(f'<text x="{X(v):.1f}" y="{H-B+16}" font-size="11" text-anchor="middle">{v:.0f}</text>'
             for v in [tmax * k / 5 for k in range(6)])
svg = f'''<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>
<text x="{W/2}" y="14" font-size="13" text-anchor="middle">RSS over {out["tokens"]} tokens ({rate:.2f} tok/s), 4 throttled drives, stripe</text>
<line x1="{L}" y1="{H-B}" x2="{W-20}" y2="{H-B}" stroke="black"/><line x1="{L}" y1="20" x2="{L}" y2="{H-B}" stroke="black"/>
{ticks}{xt}
<text x="{W/2}" y="{H-6}" font-size="12" text-anchor="middle">seconds</text>
<text x="14" y="{H/2}" font-size="12" transform="rotate(-90 14 {H/2})" text-anchor="middle">RSS (MiB)</text>
<line x1="{L}" x2="{W-20}" y1="{Y(budget_b):.1f}" y2="{Y(budget_b):.1f}" stroke="red" stroke-dasharray="6,4"/>
<text x="{W-24}" y="{Y(budget_b)-4:.1f}" font-size="11" fill="red" text-anchor="end">RAM budget {budget_b/2**20:.0f} MiB</text>
<line x1="{X(warm):.1f}" x2="{X(warm):.1f}" y1="20" y2="{H-B}" stroke="gray" stroke-dasharray="2,3"/>
<polyline fill="none" stroke="steelblue" stroke-width="1.5" points="{pts}"/>
</svg>'''
open(os.path.join(outdir, "soak.svg"), "w").write(svg)
print(json.dumps({k: res[k] for k in ["tokens", "tokens_per_s", "ram_budget_bytes", "peak_rss_bytes_reported", "peak_rss_over_budget", "after_warmup"]}, indent=1))
PY
