#!/usr/bin/env bash
# Issue 14: decode with memory capped at --cap-percent (40) of the model, deltafin vs llama.cpp,
# on the files benches/vs_llamacpp.sh made (run it first). Both run in a cgroup v1 memory
# group limited to that many bytes (page cache included); deltafin streams the experts from a
# one-drive layout (a directory on this machine's disk) with --ram-budget at the cap, llama.cpp
# maps the GGUF (llama-bench tg, mmap). Page cache dropped before each run. Also the overlap
# of deltafin's reads and compute: generation time per token over max(I/O time per token, the
# drive's busy time (a read outstanding) per token; compute time per token in RAM, `bench
# compute`). Writes
# benches/results/vs_llamacpp_cap.json.
#
#   sudo benches/vs_llamacpp_cap.sh [--formats int4,q8] [--cap-percent 40] [--decode 16]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
FORMATS=int4,q8; PCT=40; DECODE=16; LLAMA_TIMEOUT=${LLAMA_TIMEOUT:-1800}
while [ $# -gt 0 ]; do
    case $1 in
        --formats) FORMATS=$2; shift 2 ;;
        --cap-percent) PCT=$2; shift 2 ;;
        --decode) DECODE=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "needs root (cgroup, drop_caches)" >&2; exit 1; }
LLAMA_DIR=${LLAMA_DIR:-/var/tmp/deltafin-llamacpp/0.3.36}
lbin="$LLAMA_DIR/build/bin"
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}/vs-llamacpp
bin=${DELTAFIN_BIN:-$repo/target/release/deltafin}
[ -x "$bin" ] || cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
cg=/sys/fs/cgroup/memory/deltafin-cap
mkdir -p "$cg"
drive="$work/cap-drive"
cleanup() {
    for p in $(cat "$cg/cgroup.procs" 2>/dev/null); do echo "$p" > /sys/fs/cgroup/memory/cgroup.procs; done
    rmdir "$cg" 2>/dev/null || true
    rm -rf "$drive"
}
trap cleanup EXIT
in_cap() { bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" "$@"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
raw=$(mktemp)
IFS=, read -r -a formats <<< "$FORMATS"
for f in "${formats[@]}"; do
    model="$work/ds-$f"
    bytes=$(du -sb "$model" | cut -f1)
    cap=$(( bytes * PCT / 100 ))
    echo "$cap" > "$cg/memory.limit_in_bytes"
    rm -rf "$drive"; mkdir -p "$drive"
    "$bin" layout --model "$model" --drive "$drive" --name "ds-$f" --force -q >&2
    drop
    # Overlap: the drive's time for the bytes a token reads (read as decoding reads them,
    # `bench io`, hashes checked as generate checks them) and the compute time of a token
    # in RAM (`bench compute` with the page cache warm, no cap), against the decode time.
    drop
    io_gbps=$("$bin" bench io "$drive/ds-$f" --seconds 8 --rounds 2 --hash-check all --no-fio --json 2>/dev/null |
        tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['gb_per_s'])")
    cat "$model"/*.safetensors > /dev/null
    compute_tps=$("$bin" bench compute "$model" --prompt 1 --decode "$DECODE" --runs 3 --json 2>/dev/null |
        tail -1 | python3 -c "import json,sys; print(json.loads(sys.stdin.read())['decode_tokens_per_s_median'])")
    drop
    in_cap "$bin" generate --model "$drive/ds-$f" --prompt-ids 5 -n "$DECODE" --ignore-eos \
        --ram-budget "$cap" --json -q 2>/dev/null | tail -1 | python3 -c "
import json, sys
x = json.loads(sys.stdin.read())
s = x['decode_s_per_token']
# I/O time per token: the drive's busy time (a read outstanding) over the whole generation,
# per generated token; against the whole generation's time per token.
n = x['tokens']
busy_s = sum(d['busy_s'] for d in x['drive_stats'])
io_s = busy_s / n
gen_s = x['total_s'] / n
compute_s = 1.0 / $compute_tps
print(json.dumps({'engine': 'deltafin', 'format': '$f', 'cap_bytes': $cap, 'model_bytes': $bytes,
                  'tokens_per_s': 1.0 / s, 'peak_rss_bytes': x['peak_rss_bytes'],
                  'bytes_read_per_token': x.get('bytes_read_per_token'),
                  'decode_io_stall_s': x.get('decode_io_stall_s'), 'expert_cache_hit_rate': x.get('expert_cache_hit_rate'),
                  'drive_gb_per_s_bench_io': $io_gbps, 'io_s_per_token_at_bench_io_rate': x['bytes_read_per_token'] / ($io_gbps * 1e9),
                  'drive_busy_s': busy_s, 'tokens': n, 'total_s': x['total_s'],
                  'io_s_per_token': io_s, 'compute_s_per_token': compute_s,
                  'decode_s_per_token': s, 'generation_s_per_token': gen_s,
                  'overlap_ratio': gen_s / max(io_s, compute_s)}))" >> "$raw"
    rm -rf "$drive"
    for g in "$work/ds-$f.gguf" "$work/ds-$f-experts.gguf"; do
        [ -f "$g" ] || continue # bf16 has no experts-only variant
        drop
        # --repack 0: with the default repack, llama.cpp copies quantized weights into
        # anonymous memory at load, more than the cap holds (a first try did not finish
        # loading in 12 minutes); mapped as stored, the page cache can hold what fits.
        in_cap timeout "$LLAMA_TIMEOUT" "$lbin/llama-bench" -m "$g" -t 2 -p 0 -n "$DECODE" -r 1 --repack 0 \
            -o jsonl 2>/dev/null | python3 -c "
import json, sys
for l in sys.stdin:
    x = json.loads(l)
    print(json.dumps({'engine': 'llama.cpp', 'format': '$f', 'file': '$(basename "$g")', 'cap_bytes': $cap,
                      'tokens_per_s': x['avg_ts']}))" >> "$raw"
    done
done
BENCH_CMD="benches/vs_llamacpp_cap.sh $ORIG_ARGS" python3 - "$raw" "$repo/benches/results/vs_llamacpp_cap.json" "$PCT" <<'PY'
import json, os, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
table = []
for d in [r for r in rows if r["engine"] == "deltafin"]:
    for l in [r for r in rows if r["engine"] == "llama.cpp" and r["format"] == d["format"]]:
        table.append({"format": d["format"], "llama_cpp_file": l["file"], "cap_bytes": d["cap_bytes"],
                      "deltafin_tokens_per_s": d["tokens_per_s"], "llama_cpp_tokens_per_s": l["tokens_per_s"],
                      "ratio": d["tokens_per_s"] / l["tokens_per_s"],
                      "overlap_ratio": d.get("overlap_ratio"), "io_s_per_token": d.get("io_s_per_token"),
                      "compute_s_per_token": d.get("compute_s_per_token")})
out = {"benchmark": f"decode with memory capped at {sys.argv[3]}% of the model (cgroup v1), 2 threads",
       "command": os.environ.get("BENCH_CMD"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
       "drive": "one directory on this machine's virtual disk (no throttle)", "table": table, "runs": rows}
json.dump(out, open(sys.argv[2], "w"), indent=1)
for t in table:
    print(f"{t['format']:5} {t['llama_cpp_file']:22} deltafin {t['deltafin_tokens_per_s']:7.2f}  "
          f"llama.cpp {t['llama_cpp_tokens_per_s']:7.2f}  ratio {t['ratio']:.1f}x  "
          f"decode/max(io, compute) {t['overlap_ratio']:.2f} (io {t['io_s_per_token']*1e3:.1f} ms, compute {t['compute_s_per_token']*1e3:.1f} ms)")
PY
rm -f "$raw"
