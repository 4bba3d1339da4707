#!/usr/bin/env bash
# Issue 14: every kernel near memory bandwidth on each instruction set deltafin dispatches to,
# measured on this machine's hardware by capping the dispatch (DELTAFIN_KERNELS): AVX-512 with
# VNNI (the default where present), AVX-512 without VNNI (avx512bw: the kind of machine issue 14
# was filed on) and AVX2 (`--levels ...,scalar` adds the portable reference as a floor).
# Per format and level:
#   examples/stream_rate FORMAT MIB N : GB/s of expert weights streamed from DRAM (MIB of
#       expert-shaped matrices, N inputs per expert), next to a plain read of the same bytes
#       (`read`, the ceiling) in the same process;
#   examples/gemm_rate 1024 1024 32 FORMAT : GMAC/s of a 32-input matrix product (prefill) on
#       in-cache weights.
# Levels alternate within each format so that drift hits them alike. Writes
# benches/results/isa_sweep${OUT_SUFFIX}.txt.
#   benches/isa_sweep.sh [--levels avx512,avx512bw,avx2] [--formats bf16,q8,int4,mxfp4]
#                        [--mib 768] [--sweeps 7] [--rounds 2]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
LEVELS=avx512,avx512bw,avx2; FORMATS=bf16,q8,int4,mxfp4; MIB=768; SWEEPS=7; ROUNDS=2
while [ $# -gt 0 ]; do
    case $1 in
        --levels) LEVELS=$2; shift 2 ;;
        --formats) FORMATS=$2; shift 2 ;;
        --mib) MIB=$2; shift 2 ;;
        --sweeps) SWEEPS=$2; shift 2 ;;
        --rounds) ROUNDS=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
cargo build --release -p deltafin-inference --example stream_rate --example gemm_rate \
    --manifest-path "$repo/Cargo.toml" >&2
ex="$repo/target/release/examples"
out="$repo/benches/results/isa_sweep${OUT_SUFFIX:-}.txt"
IFS=, read -r -a levels <<< "$LEVELS"
IFS=, read -r -a formats <<< "$FORMATS"
{
    echo "# benches/isa_sweep.sh --levels $LEVELS --formats $FORMATS --mib $MIB --sweeps $SWEEPS --rounds $ROUNDS"
    echo "# $(date -u +%FT%TZ), commit $(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet || echo '+dirty')"
    echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) threads;" \
        "flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx2|fma|avx512f|avx512bw|avx512_vnni|avx_vnni|avx512_bf16|amx_tile' | tr '\n' ' ')"
    for f in "${formats[@]}"; do
        for ((r = 1; r <= ROUNDS; r++)); do
            for l in "${levels[@]}"; do
                for n in 1 2; do
                    line=$(DELTAFIN_KERNELS=$l STREAM_RATE_SWEEPS=$SWEEPS "$ex/stream_rate" "$f" "$MIB" "$n" 2>&1 | tail -1)
                    echo "stream  level=$l round=$r $line"
                done
                line=$(DELTAFIN_KERNELS=$l "$ex/gemm_rate" 1024 1024 32 "$f" 2>&1 | tail -1)
                echo "gemm32  level=$l round=$r $line"
            done
        done
    done
} | tee "$out"
