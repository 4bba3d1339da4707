#!/usr/bin/env bash
# A/B runs of decode at a 40% memory cap on one paced emulated drive (issue 14's overlap), for
# comparing settings of one binary: each variant is a shell snippet evaluated before the run
# (it may set UNIT, stripe unit of the layout; TPD, --threads-per-drive; HC, --hash-check;
# ARGS, extra generate arguments; ENVS, environment for deltafin; BIN, another deltafin binary
# reading the same layout), variants alternated round by round. One line per run: decode ms
# per token, I/O ms per token at the drive's rate
# (landed records / all the drive's bytes) and the two overlap ratios, as
# benches/vs_llamacpp_cap.sh counts them (compute time is far below I/O time here); then the
# medians per variant.
#   sudo BENCH_ROOT=/dev/shm/deltafin-bench benches/cap_ab.sh [--format int4] [--rounds 6]
#        [--decode 48] [--rate 1073741824] [--trace DIR] [--model DIR] -- 'VARIANT' ['VARIANT' ...]
#        [--pct 40]
# (--model: another checkpoint than benches/vs_llamacpp.sh's ds-FORMAT, e.g. a Kimi K3 synth;
# --pct: the memory cap, percent of the checkpoint's bytes)
# e.g. benches/cap_ab.sh -- 'UNIT=512K' 'UNIT=128K' 'ARGS=--no-prefetch' 'TPD=2' 'BIN=/tmp/old'

set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
FORMAT=int4; ROUNDS=6; DECODE=48; RATE=1073741824; TRACE_DIR=""; PCT=40; MODEL=""
while [ $# -gt 0 ]; do
    case $1 in
        --format) FORMAT=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --decode) DECODE=$2; shift 2 ;;
        --rate) RATE=$2; shift 2 ;;
        --trace) TRACE_DIR=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --pct) PCT=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "give the variants after --" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "needs root (cgroup, loop device)" >&2; exit 1; }
variants=("$@")
bin=${DELTAFIN_BIN:-$repo/target/release/deltafin}
[ -x "$bin" ] || cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
model=${MODEL:-${BENCH_WORK:-/var/tmp/deltafin-bench-model}/vs-llamacpp/ds-$FORMAT}
[ -f "$model/config.json" ] || { echo "no $model: run benches/vs_llamacpp.sh first" >&2; exit 1; }
source "$here/emulated_drives.sh"
cg=/sys/fs/cgroup/memory/deltafin-cap-ab
mkdir -p "$cg"
cap=$(( $(du -sb "$model" | cut -f1) * PCT / 100 ))
echo "$cap" > "$cg/memory.limit_in_bytes"
cleanup() {
    for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do echo "$p" > /sys/fs/cgroup/memory/cgroup.procs; done
    # The group can stay busy for a moment after its last process exits.
    for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir "$cg" 2>/dev/null && break; sleep 0.5; done
    drives_teardown
}
drives_setup 1 24 "$RATE"
# After drives_setup, whose own EXIT trap this replaces (cleanup tears the drive down too).
trap cleanup EXIT
drive="$BENCH_MNT/d0"
laid=" "
raw=$(mktemp)
for ((r = 0; r < ROUNDS; r++)); do
    for i in "${!variants[@]}"; do
        UNIT=512K; TPD=4; HC=all; ARGS=""; ENVS=""; BIN=$bin
        eval "${variants[$i]}"
        if [[ "$laid" != *" $UNIT "* ]]; then
            "$bin" layout --model "$model" --drive "$drive" --name "u$UNIT" --stripe-unit "$UNIT" --force -q >&2
            laid="$laid$UNIT "
        fi
        trace=(); [ -z "$TRACE_DIR" ] || trace=(--trace "$TRACE_DIR/v${i}_r$r.jsonl")
        drop_caches
        # shellcheck disable=SC2086 # ENVS and ARGS are word lists
        out=$(bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" env $ENVS "$BIN" generate \
            --model "$drive/u$UNIT" --prompt-ids 5 -n "$DECODE" --ignore-eos --ram-budget "$cap" \
            --threads-per-drive "$TPD" --hash-check "$HC" --pace-drives "$RATE" $ARGS "${trace[@]}" \
            --json -q 2>"$raw.err" | tail -1) || true
        if [ -z "$out" ]; then
            # Killed (the memory cgroup's OOM killer: see dmesg) or failed: say so, do not
            # drop the run silently.
            echo "variant $i round $r: no result ($(tail -c 300 "$raw.err"))" >&2
            continue
        fi
        echo "$out" | python3 -c "
import json, sys
x = json.loads(sys.stdin.read()); s = x['decode_s_per_token']
io, iod = x['bytes_read_per_token'] / $RATE, x['drive_bytes_read_per_token'] / $RATE
print(json.dumps({'variant': $i, 'round': $r, 'decode_ms': s * 1e3, 'io_ms': io * 1e3, 'io_drive_ms': iod * 1e3,
                  'overlap_ratio': s / io, 'overlap_ratio_drive_bytes': s / iod,
                  'hit_rate': x.get('decode_expert_cache_hit_rate'),
                  'prefetch_precision': x.get('decode_prefetch_precision'), 'prefetch_recall': x.get('decode_prefetch_recall'),
                  'repredictions': x.get('fetch', {}).get('repredictions'), 'rank_precision': x.get('prefetch_rank_precision'), 'rank_precision_early': x.get('prefetch_rank_precision_early'), 'peak_rss_mib': round(x.get('peak_rss_bytes', 0) / 2**20, 1),
                  'tokens': x.get('tokens'), 'fetch': x.get('fetch'), 'next_token_guess': x.get('next_token_guess')}))" | tee -a "$raw"
    done
done
python3 - "$raw" "${variants[@]}" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for i, v in enumerate(sys.argv[2:]):
    mine = [r for r in rows if r["variant"] == i]
    med = lambda k: statistics.median(r[k] for r in mine)
    print(f"variant {i} [{v}]: decode {med('decode_ms'):.2f} ms, io {med('io_ms'):.2f} / drive "
          f"{med('io_drive_ms'):.2f} ms, overlap {med('overlap_ratio'):.3f} / {med('overlap_ratio_drive_bytes'):.3f}"
          f" (medians of {len(mine)}; decode {sorted(round(r['decode_ms'], 2) for r in mine)})")
PY
rm -f "$raw" "$raw.err"
