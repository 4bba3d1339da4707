#!/usr/bin/env bash
# Issue 6 measurements on 4 emulated drives (stripe, each throttled to --bps): the replay-drafter
# table (tokens/s against acceptance and k, adaptive and fixed) and the snapshot TTFT, through
# benches/speculative.py, for two synthetic DeepSeek-V3 models under a RAM budget:
#  - `medium` (64 routed experts, top-6): realistic sparsity, the verified positions share few
#    experts (random routing), so verifying k drafts reads nearly k+1 times the bytes;
#  - `dense16` (medium with 16 routed experts, top-8): positions share most experts, the case
#    where one verify pass reads far fewer bytes than k+1 plain steps.
# Writes benches/results/speculative_<model>.json.
#   sudo benches/speculative.sh [--bps B] [--new 48] [--repeats 1] [--models "medium dense16"]
#        [--ks adaptive,2,4,8] [--merge]   (--merge: rerun only those rows into the existing JSON)
#        [--snapshot-only]                 (only the snapshot TTFT, into the existing JSON)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
ORIG_ARGS="$*"; BPS=$((150 * 1024 * 1024)); NEW=48; REPEATS=1; MODELS="medium dense16"; PYX=()
while [ $# -gt 0 ]; do
    case $1 in
        --bps) BPS=$2; shift 2 ;;
        --new) NEW=$2; shift 2 ;;
        --repeats) REPEATS=$2; shift 2 ;;
        --models) MODELS=$2; shift 2 ;;
        --ks) PYX+=(--ks "$2"); shift 2 ;;
        --merge) PYX+=(--merge); shift ;;
        --snapshot-only) PYX+=(--snapshot-only); shift ;;
        *) echo "unknown $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/speculative.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
export DELTAFIN_BIN="$bin"
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
synth_model() {
    case $1 in
        medium) [ -f "$work/medium/config.json" ] ||
            "$bin" synth --out "$work/medium" --preset medium --seed 1 --force -q ;;
        dense16) [ -f "$work/dense16/config.json" ] ||
            "$bin" synth --out "$work/dense16" --preset medium --seed 1 --force -q \
                --set n_routed_experts=16 --set num_experts_per_tok=8 ;;
        *) echo "unknown model $1" >&2; exit 2 ;;
    esac
}
budget_of() { case $1 in medium) echo 700M ;; dense16) echo 300M ;; esac; }
total=0
for m in $MODELS; do
    synth_model "$m"
    total=$(( total + $(du -sb "$work/$m" | cut -f1) ))
done
drives_setup 4 $(( total / 4 / 1000000000 + 2 )) "$BPS"
args=(); for i in 0 1 2 3; do args+=(--drive "$BENCH_MNT/d$i"); done
for m in $MODELS; do
    "$bin" layout --model "$work/$m" "${args[@]}" --mode stripe --name "$m" --force -q >&2
    drop_caches
    # Children inherit the throttled cgroup.
    in_throttled python3 "$here/speculative.py" "$BENCH_MNT/d0/$m/manifest.json" \
        --ram-budget "$(budget_of "$m")" --new "$NEW" --repeats "$REPEATS" \
        --out "benches/results/speculative_$m.json" "${PYX[@]}"
done
