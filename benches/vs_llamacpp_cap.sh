#!/usr/bin/env bash
# Issue 14: decode with memory capped at --cap-percent (40) of the model, deltafin vs llama.cpp,
# on the files benches/vs_llamacpp.sh made (run it first). Both run in a cgroup v1 memory
# group limited to that many bytes (page cache included); deltafin streams the experts from a
# one-drive layout with --ram-budget at the cap, llama.cpp maps the GGUF (llama-bench tg,
# mmap, --repack 0). Page cache dropped before each run.
#
# The drive: by default a directory on this machine's (virtual) disk. With --throttle BPS, one
# emulated drive instead (benches/emulated_drives.sh: a loop device with a cgroup v1 blkio read
# throttle of BPS bytes/s) holding both engines' files: a drive whose rate is known, as an
# SSD's is. llama.cpp reads through the blkio throttle, which credits up to 100 ms of a drive's
# idle time to the next read (in llama.cpp's favour). deltafin paces its own reads to BPS
# instead (--pace-drives: no idle credit, the drive model the I/O time below assumes); under
# both at once its reads paid two independent throttles, no real drive's behaviour (INT4
# overlap 1.20-1.35 with both vs 1.15-1.18 paced only, session 18).
#
# Overlap of deltafin's reads and compute, per decoded token:
#   I/O time     = bytes per decoded token / the drive's rate, counted two ways: the records
#                  that landed in the expert cache (`bytes_read_per_token`, as sessions up to 24
#                  counted: prefetches cancelled part-read are left out) and everything the
#                  drive transferred (`drive_bytes_read_per_token`: the drive's time); the rate
#                  is the throttle (deltafin
#                  then also paces its reads to it: --pace-drives), or (the virtual disk) the
#                  mean of what fio reads of the layout's data file in the engine's pattern
#                  (O_DIRECT pread, 512 KiB random pieces, one job per engine thread) just
#                  before and just after the run
#   compute time = decode time per token of the same model in RAM (`bench compute`, median)
#   ratio        = decode time per token / max(I/O time, compute time)       (target <= 1.1)
#                  (`overlap_ratio`: with the landed records' bytes, as before;
#                  `overlap_ratio_drive_bytes`: with the drive's, which leaves the wasted part
#                  of cancelled prefetches out of the overlap's charge)
# The drive's busy time (a read outstanding) is recorded too. Writes
# benches/results/vs_llamacpp_cap${OUT_SUFFIX}.json.
#
#   sudo benches/vs_llamacpp_cap.sh [--formats int4,q8,bf16] [--cap-percent 40] [--decode 16]
#        [--throttle BPS] [--rounds 1] [--hash-check all|sampled:N|off] [--no-llama]
# --hash-check is passed to deltafin's generate (default all, as a user runs it); --no-llama
# runs deltafin alone (overlap only, no ratio). BENCH_ROOT=/dev/shm/... puts the --throttle
# drive's image in RAM: a drive that always keeps up with the throttle (this machine's virtual
# disk drifts between 0.7 and 2.3 GB/s), at the cost of a kernel memcpy per byte read.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
FORMATS=int4,q8,bf16; PCT=40; DECODE=16; THROTTLE=""; ROUNDS=1; HASH_CHECK=all; NO_LLAMA=""
LLAMA_TIMEOUT=${LLAMA_TIMEOUT:-1800}; THREADS_PER_DRIVE=4
while [ $# -gt 0 ]; do
    case $1 in
        --formats) FORMATS=$2; shift 2 ;;
        --cap-percent) PCT=$2; shift 2 ;;
        --decode) DECODE=$2; shift 2 ;;
        --throttle) THROTTLE=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        --hash-check) HASH_CHECK=$2; shift 2 ;;
        --no-llama) NO_LLAMA=1; shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "needs root (cgroup, drop_caches)" >&2; exit 1; }
LLAMA_DIR=${LLAMA_DIR:-/var/tmp/deltafin-llamacpp/0.3.36}
lbin="$LLAMA_DIR/build/bin"
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}/vs-llamacpp
bin=${DELTAFIN_BIN:-$repo/target/release/deltafin}
[ -x "$bin" ] || cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
command -v fio > /dev/null || { echo "needs fio" >&2; exit 1; }
cg=/sys/fs/cgroup/memory/deltafin-cap
mkdir -p "$cg"
if [ -n "$THROTTLE" ]; then
    source "$here/emulated_drives.sh"
    drives_setup 1 24 "$THROTTLE"
    drive="$BENCH_MNT/d0"
    blk="$BENCH_CGROUP"
else
    drive="$work/cap-drive"
    blk=""
fi
cleanup() {
    for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do echo "$p" > /sys/fs/cgroup/memory/cgroup.procs; done
    rmdir "$cg" 2>/dev/null || true
    [ -n "$THROTTLE" ] && drives_teardown
    [ -n "$THROTTLE" ] || rm -rf "$drive"
}
trap cleanup EXIT
# Into the memory cap (and the drive's throttle), then exec.
in_cap() { bash -c 'echo $$ > "$0/cgroup.procs" && { [ -z "$1" ] || echo $$ > "$1/cgroup.procs"; } && shift && exec "$@"' "$cg" "$blk" "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
raw=$(mktemp)
IFS=, read -r -a formats <<< "$FORMATS"
for f in "${formats[@]}"; do
    model="$work/ds-$f"
    [ -f "$model/config.json" ] || { echo "no $model: run benches/vs_llamacpp.sh first" >&2; exit 1; }
    bytes=$(du -sb "$model" | cut -f1)
    cap=$(( bytes * PCT / 100 ))
    echo "$cap" > "$cg/memory.limit_in_bytes"
    [ -n "$THROTTLE" ] || { rm -rf "$drive"; mkdir -p "$drive"; }
    "$bin" layout --model "$model" --drive "$drive" --name "ds-$f" --force -q >&2
    ggufs=()
    for g in "$work/ds-$f.gguf" "$work/ds-$f-experts.gguf"; do
        [ -f "$g" ] || continue # bf16 has no experts-only variant
        if [ -n "$THROTTLE" ] && [ -z "$NO_LLAMA" ]; then cp "$g" "$drive/"; ggufs+=("$drive/$(basename "$g")"); else ggufs+=("$g"); fi
    done
    # Compute time of a token in RAM (page cache warm, no cap).
    cat "$model"/*.safetensors > /dev/null
    compute_tps=$("$bin" bench compute "$model" --prompt 1 --decode "$DECODE" --runs 3 --json 2>/dev/null |
        tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['decode_tokens_per_s_median'])")
    for ((r = 0; r < ROUNDS; r++)); do
        # The drive's rate for deltafin's reads: the throttle, or fio in the same pattern just
        # before and just after the run (the virtual disk's rate drifts by a third between
        # minutes): their mean.
        fio_rate() {
            drop
            fio --name=r --filename="$drive/ds-$f/data.bin" --rw=randread --bs=512k --direct=1 \
                --ioengine=psync --numjobs=$THREADS_PER_DRIVE --runtime=8 --time_based --group_reporting \
                --output-format=json 2>/dev/null | python3 -c "import json,sys; print(json.load(sys.stdin)['jobs'][0]['read']['bw_bytes'])"
        }
        if [ -n "$THROTTLE" ]; then
            rate=$THROTTLE; rate_before=$THROTTLE
            # deltafin paces its own reads to the throttle too: the blkio throttle credits a
            # drive's idle time to the next read, which a real drive does not.
            pace=(--pace-drives "$THROTTLE")
        else
            rate_before=$(fio_rate); pace=()
        fi
        drop
        # Paced, deltafin stays out of the blkio group (see the header).
        blk_saved=$blk; [ -n "$THROTTLE" ] && blk=""
        out=$(in_cap "$bin" generate --model "$drive/ds-$f" --prompt-ids 5 -n "$DECODE" --ignore-eos \
            --ram-budget "$cap" --threads-per-drive $THREADS_PER_DRIVE --hash-check "$HASH_CHECK" "${pace[@]}" --json -q 2>/dev/null | tail -1)
        blk=$blk_saved
        if [ -n "$THROTTLE" ]; then rate_after=$THROTTLE; else rate_after=$(fio_rate); fi
        rate=$(( (rate_before + rate_after) / 2 ))
        echo "$out" | python3 -c "
import json, sys
x = json.loads(sys.stdin.read())
s = x['decode_s_per_token']
n = x['tokens']
busy_s = sum(d['busy_s'] for d in x['drive_stats'])
io_s = x['bytes_read_per_token'] / $rate
# Builds before session 25 do not report the drive's bytes: the landed ones stand in.
io_drive_s = x.get('drive_bytes_read_per_token', x['bytes_read_per_token']) / $rate
compute_s = 1.0 / $compute_tps
print(json.dumps({'engine': 'deltafin', 'format': '$f', 'round': $r, 'cap_bytes': $cap, 'model_bytes': $bytes,
                  'hash_check': '$HASH_CHECK',
                  'tokens_per_s': 1.0 / s, 'peak_rss_bytes': x['peak_rss_bytes'],
                  'bytes_read_per_token': x['bytes_read_per_token'],
                  'drive_bytes_read_per_token': x.get('drive_bytes_read_per_token'),
                  'decode_io_stall_s': x.get('decode_io_stall_s'),
                  'decode_expert_cache_hit_rate': x.get('decode_expert_cache_hit_rate'),
                  'drive_rate_bytes_per_s': $rate, 'drive_rate_source': 'throttle' if '$THROTTLE' else 'fio',
                  'drive_rate_before_after': [$rate_before, $rate_after],
                  'expert_memory_preallocated': x.get('budget', {}).get('expert_memory_preallocated'),
                  'expert_memory_preallocate_s': x.get('budget', {}).get('expert_memory_preallocate_ms', 0) / 1e3,
                  'drive_busy_s_per_token': busy_s / n, 'tokens': n,
                  'io_s_per_token': io_s, 'io_drive_s_per_token': io_drive_s,
                  'compute_s_per_token': compute_s, 'decode_s_per_token': s,
                  'overlap_ratio': s / max(io_s, compute_s),
                  'overlap_ratio_drive_bytes': s / max(io_drive_s, compute_s)}))" >> "$raw"
        [ -n "$NO_LLAMA" ] && continue
        for g in "${ggufs[@]}"; do
            drop
            in_cap timeout "$LLAMA_TIMEOUT" "$lbin/llama-bench" -m "$g" -t 2 -p 0 -n "$DECODE" -r 1 --repack 0 \
                -o jsonl 2>/dev/null | python3 -c "
import json, sys
for l in sys.stdin:
    x = json.loads(l)
    print(json.dumps({'engine': 'llama.cpp', 'format': '$f', 'round': $r, 'file': '$(basename "$g")', 'cap_bytes': $cap,
                      'tokens_per_s': x['avg_ts']}))" >> "$raw" || echo "llama-bench on $g failed or timed out" >&2
        done
    done
    if [ -n "$THROTTLE" ]; then rm -rf "$drive/ds-$f" "$drive"/*.gguf; fstrim "$drive" || true; else rm -rf "$drive"; fi
done
BENCH_CMD="benches/vs_llamacpp_cap.sh $ORIG_ARGS" THROTTLE="$THROTTLE" python3 - "$raw" \
    "$repo/benches/results/vs_llamacpp_cap${OUT_SUFFIX:-}.json" "$PCT" <<'PY'
import json, os, sys, datetime, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
table = []
for f in dict.fromkeys(r["format"] for r in rows):
    ours = [r for r in rows if r["engine"] == "deltafin" and r["format"] == f]
    files = list(dict.fromkeys(r["file"] for r in rows if r["engine"] == "llama.cpp" and r["format"] == f))
    for file in files or [None]:
        theirs = [r for r in rows if r["engine"] == "llama.cpp" and r["format"] == f and r["file"] == file]
        o = statistics.median(r["tokens_per_s"] for r in ours)
        t = statistics.median(r["tokens_per_s"] for r in theirs) if theirs else None
        table.append({"format": f, "llama_cpp_file": file, "cap_bytes": ours[0]["cap_bytes"],
                      "hash_check": ours[0].get("hash_check"),
                      "deltafin_tokens_per_s": o, "llama_cpp_tokens_per_s": t, "ratio": o / t if t else None,
                      "overlap_ratio": statistics.median(r["overlap_ratio"] for r in ours),
                      "overlap_ratios": [r["overlap_ratio"] for r in ours],
                      "overlap_ratio_drive_bytes": statistics.median(r["overlap_ratio_drive_bytes"] for r in ours),
                      "overlap_ratios_drive_bytes": [r["overlap_ratio_drive_bytes"] for r in ours],
                      "io_s_per_token": statistics.median(r["io_s_per_token"] for r in ours),
                      "io_drive_s_per_token": statistics.median(r["io_drive_s_per_token"] for r in ours),
                      "compute_s_per_token": ours[0]["compute_s_per_token"],
                      "decode_s_per_token": statistics.median(r["decode_s_per_token"] for r in ours)})
thr = os.environ.get("THROTTLE")
out = {"benchmark": f"decode with memory capped at {sys.argv[3]}% of the model (cgroup v1), 2 threads",
       "command": os.environ.get("BENCH_CMD"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
       "drive": (f"one emulated drive (loop device) holding both engines' files: llama.cpp through a blkio read throttle of {thr} B/s, deltafin paced to {thr} B/s (--pace-drives) outside it"
                 if thr else "one directory on this machine's virtual disk (no throttle); I/O time at fio's rate"),
       "table": table, "runs": rows}
json.dump(out, open(sys.argv[2], "w"), indent=1)
for t in table:
    theirs = (f"llama.cpp {t['llama_cpp_tokens_per_s']:7.2f}  ratio {t['ratio']:.1f}x  "
              if t["ratio"] else "")
    print(f"{t['format']:5} {t['llama_cpp_file'] or '-':22} deltafin {t['deltafin_tokens_per_s']:7.2f}  {theirs}"
          f"decode/max(io, compute) {t['overlap_ratio']:.2f} (io {t['io_s_per_token']*1e3:.1f} ms, "
          f"compute {t['compute_s_per_token']*1e3:.1f} ms, decode {t['decode_s_per_token']*1e3:.1f} ms); "
          f"with all the drive's bytes {t['overlap_ratio_drive_bytes']:.2f} (io {t['io_drive_s_per_token']*1e3:.1f} ms)")
PY
rm -f "$raw"
