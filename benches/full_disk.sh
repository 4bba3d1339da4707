#!/usr/bin/env bash
# Real full-disk and interrupted-layout checks on loop-device filesystems (needs root).
#
#   sudo benches/full_disk.sh [--out benches/results/full_disk.json]
#
# Two ext4 loop drives: d0 (1 GiB) and d1 (64 MiB, too small for a replicated copy of the
# ~145 MB synthetic model). Checks, each recorded in the JSON:
#  1. full disk: a replicated layout over d0+d1 fails before writing data, naming drive 1, its
#     path and the bytes needed/free; neither drive holds a manifest afterwards (nothing looks
#     complete), and an earlier complete layout on d0 still verifies;
#  2. interrupted layout: `layout` killed with SIGKILL at 10%..110% of its uninterrupted time is
#     at every kill point either complete (manifest present and verify passes) or not a layout
#     (no manifest, verify refuses); the earlier layout still verifies; re-running an
#     interrupted layout without --force completes and verifies.
# Tests never need this: the unit and integration tests use plain temp directories.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benches/results/full_disk.json
while [ $# -gt 0 ]; do
    case $1 in
        --out) OUT=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "needs root (loop devices, mkfs, mount)" >&2; exit 1; }

ROOT=/var/tmp/deltafin-fulldisk
MNT=/mnt/deltafin-fulldisk
LOOPS=()
teardown() {
    set +e
    for i in "${!LOOPS[@]}"; do
        umount "$MNT/d$i" 2>/dev/null
        losetup -d "${LOOPS[$i]}" 2>/dev/null
    done
    rm -rf "$ROOT" 2>/dev/null
    rmdir "$MNT"/d* "$MNT" 2>/dev/null
}
trap teardown EXIT
trap 'teardown; exit 130' INT TERM
teardown
mkdir -p "$ROOT" "$MNT"
i=0
for size in 1G 64M; do
    img="$ROOT/d$i.img"
    truncate -s "$size" "$img"
    dev=$(losetup -f --show "$img")
    LOOPS[$i]=$dev
    mkfs.ext4 -q -F -E nodiscard "$dev"
    mkdir -p "$MNT/d$i"
    mount -o noatime "$dev" "$MNT/d$i"
    i=$((i + 1))
done

cargo build --release -q -p deltafin
BIN=target/release/deltafin
MODEL=$ROOT/model
$BIN synth --out "$MODEL" --preset small -q >/dev/null 2>&1 || $BIN synth --out "$MODEL" --preset small >/dev/null
model_bytes=$(du -sb "$MODEL" | cut -f1)

# An earlier complete layout on d0, which nothing below may damage.
$BIN layout --model "$MODEL" --drive "$MNT/d0" --name keep -q
$BIN verify "$MNT/d0/keep" -q

# 1. Full disk.
set +e
full_err=$($BIN layout --model "$MODEL" --drive "$MNT/d0" --drive "$MNT/d1" --mode replicate --name full -q 2>&1)
full_rc=$?
set -e
full_manifests=$( (find "$MNT/d0/full" "$MNT/d1/full" -name manifest.json 2>/dev/null || true) | wc -l)
keep_after_full=$($BIN verify "$MNT/d0/keep" -q >/dev/null 2>&1 && echo ok || echo FAILED)
echo "full disk: rc=$full_rc, manifests left: $full_manifests, earlier layout: $keep_after_full" >&2
echo "  $full_err" >&2

# 2. Interrupted layout: SIGKILL at 10%..110% of the uninterrupted time. At every kill point
# the layout is either complete (manifest present, verify passes) or visibly not a layout
# (no manifest, verify refuses); never a manifest over bad data.
start=$(date +%s.%N)
$BIN layout --model "$MODEL" --drive "$MNT/d0" --name cut -q
whole=$(echo "$(date +%s.%N) - $start" | bc)
kills="["
consistent=true
for frac in 0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 0.95 1.0 1.05 1.1; do
    rm -rf "$MNT/d0/cut"
    sync
    $BIN layout --model "$MODEL" --drive "$MNT/d0" --name cut -q >/dev/null 2>&1 &
    pid=$!
    sleep "$(echo "$whole * $frac" | bc -l)"
    kill -9 $pid 2>/dev/null || true
    wait $pid 2>/dev/null || true
    data=$(stat -c %s "$MNT/d0/cut/data.bin" 2>/dev/null || echo 0)
    manifest=$([ -e "$MNT/d0/cut/manifest.json" ] && echo present || echo absent)
    set +e
    verr=$($BIN verify "$MNT/d0/cut" -q 2>&1 | tail -1)
    vrc=${PIPESTATUS[0]}
    set -e
    if { [ "$manifest" = present ] && [ "$vrc" != 0 ]; } || { [ "$manifest" = absent ] && [ "$vrc" = 0 ]; }; then
        consistent=false
    fi
    echo "kill at ${frac}: data.bin $data bytes, manifest $manifest, verify rc=$vrc: $verr" >&2
    kills="$kills{\"fraction\": $frac, \"data_bin_bytes\": $data, \"manifest\": \"$manifest\", \"verify_exit_code\": $vrc, \"verify_message\": $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$verr")},"
done
kills="${kills%,}]"
# Leave an interrupted one behind, then re-run without --force.
rm -rf "$MNT/d0/cut"
$BIN layout --model "$MODEL" --drive "$MNT/d0" --name cut -q >/dev/null 2>&1 &
pid=$!
sleep "$(echo "$whole * 0.3" | bc -l)"
kill -9 $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
set +e
rerun=$($BIN layout --model "$MODEL" --drive "$MNT/d0" --name cut -q 2>&1)
rerun_rc=$?
$BIN verify "$MNT/d0/cut" -q >/dev/null 2>&1
rerun_verify_rc=$?
keep_after_cut=$($BIN verify "$MNT/d0/keep" -q >/dev/null 2>&1 && echo ok || echo FAILED)
set -e
echo "uninterrupted layout ${whole}s; consistent at every kill point: $consistent; rerun rc=$rerun_rc, verify rc=$rerun_verify_rc, earlier layout: $keep_after_cut" >&2

mkdir -p "$(dirname "$OUT")"
python3 - "$OUT" <<EOF
import json, sys
out = {
    "what": "real full-disk and interrupted-layout checks on ext4 loop drives (benches/full_disk.sh)",
    "machine": "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores",
    "date": "$(date -u +%Y-%m-%dT%H:%MZ)",
    "commit": "$(git rev-parse --short HEAD)",
    "model_bytes": $model_bytes,
    "drives": {"d0": "1 GiB ext4", "d1": "64 MiB ext4"},
    "full_disk": {
        "command": "deltafin layout --drive d0 --drive d1 --mode replicate",
        "exit_code": $full_rc,
        "error": $(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$full_err"),
        "manifests_left": $full_manifests,
        "earlier_layout_verifies": "$keep_after_full" == "ok",
    },
    "interrupted": {
        "uninterrupted_layout_s": round($whole, 3),
        "kills": $kills,
        "consistent_at_every_kill": "$consistent" == "true",
        "rerun_without_force_exit_code": $rerun_rc,
        "rerun_verify_exit_code": $rerun_verify_rc,
        "earlier_layout_verifies": "$keep_after_cut" == "ok",
    },
}
ok = (out["full_disk"]["exit_code"] != 0 and out["full_disk"]["manifests_left"] == 0
      and out["full_disk"]["earlier_layout_verifies"] and out["interrupted"]["consistent_at_every_kill"]
      and out["interrupted"]["rerun_without_force_exit_code"] == 0
      and out["interrupted"]["rerun_verify_exit_code"] == 0 and out["interrupted"]["earlier_layout_verifies"])
out["all_checks_pass"] = ok
json.dump(out, open(sys.argv[1], "w"), indent=1)
print("all checks pass" if ok else "A CHECK FAILED", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
