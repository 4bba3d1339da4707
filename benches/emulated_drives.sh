#!/usr/bin/env bash
# Emulated drives: loop devices on files (O_DIRECT backing), ext4, mounted, each with its own
# cgroup v1 blkio read throttle. Source this file, then:
#   drives_setup N SIZE_GB READ_BPS     -> mounts /mnt/deltafin-bench/d0..d{N-1}
#   in_throttled CMD ARGS...            -> runs CMD inside the throttled cgroup
#   drives_teardown                     -> unmounts, detaches, removes images and cgroup
# drives_setup installs a trap so everything is torn down on exit, Ctrl-C or TERM.
# Needs root, losetup, mkfs.ext4 and the cgroup v1 blkio controller.

BENCH_ROOT=${BENCH_ROOT:-/var/tmp/deltafin-bench}
BENCH_MNT=${BENCH_MNT:-/mnt/deltafin-bench}
BENCH_CGROUP=${BENCH_CGROUP:-/sys/fs/cgroup/blkio/deltafin-bench}
BENCH_LOOPS=()

drives_teardown() {
    set +e
    for i in "${!BENCH_LOOPS[@]}"; do
        umount "$BENCH_MNT/d$i" 2>/dev/null
        losetup -d "${BENCH_LOOPS[$i]}" 2>/dev/null
    done
    BENCH_LOOPS=()
    # Also clean up anything a killed earlier run left behind.
    for m in "$BENCH_MNT"/d*; do
        mountpoint -q "$m" 2>/dev/null && umount "$m"
    done
    for img in "$BENCH_ROOT"/drive*.img; do
        [ -e "$img" ] || continue
        for dev in $(losetup -j "$img" -O NAME -n 2>/dev/null); do losetup -d "$dev"; done
        rm -f "$img"
    done
    if [ -d "$BENCH_CGROUP" ]; then
        for p in $(cat "$BENCH_CGROUP/cgroup.procs" 2>/dev/null); do
            echo "$p" > "$(dirname "$BENCH_CGROUP")/cgroup.procs" 2>/dev/null
        done
        rmdir "$BENCH_CGROUP" 2>/dev/null
    fi
    rmdir "$BENCH_MNT"/d* 2>/dev/null
}

drives_setup() {
    local n=$1 size_gb=$2 bps=$3
    [ "$(id -u)" = 0 ] || { echo "emulated drives need root" >&2; return 1; }
    [ -d "$(dirname "$BENCH_CGROUP")" ] || { echo "no cgroup v1 blkio controller at $(dirname "$BENCH_CGROUP")" >&2; return 1; }
    # One emulated-drive benchmark at a time on this machine: a second run waits here.
    exec 9>/var/tmp/deltafin-bench.lock
    flock 9
    trap 'drives_teardown' EXIT
    trap 'drives_teardown; exit 130' INT TERM
    drives_teardown
    mkdir -p "$BENCH_ROOT" "$BENCH_MNT" "$BENCH_CGROUP"
    for ((i = 0; i < n; i++)); do
        local img="$BENCH_ROOT/drive$i.img"
        truncate -s "${size_gb}G" "$img"
        local dev
        dev=$(losetup --direct-io=on -f --show "$img")
        BENCH_LOOPS[$i]=$dev
        mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=0,lazy_journal_init=0 "$dev"
        mkdir -p "$BENCH_MNT/d$i"
        mount -o noatime "$dev" "$BENCH_MNT/d$i"
        local majmin
        majmin=$(lsblk -dno MAJ:MIN "$dev" | tr -d ' ')
        echo "$majmin $bps" > "$BENCH_CGROUP/blkio.throttle.read_bps_device"
        echo "drive $i: $dev ($majmin) on $BENCH_MNT/d$i, reads throttled to $bps B/s" >&2
    done
}

in_throttled() {
    bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$BENCH_CGROUP" "$@"
}

drop_caches() {
    sync
    echo 3 > /proc/sys/vm/drop_caches
}
