#!/usr/bin/env bash
# Issue 13: every parser of untrusted bytes under libFuzzer (cargo fuzz, nightly), SECONDS each,
# two targets at a time. Each run starts from the repo's corpus (fuzz/corpus/TARGET); afterwards
# the corpus is merged back minimized (-merge=1), so the repo keeps a small corpus that covers
# what the run reached. Crashes land in fuzz/artifacts/TARGET. Writes benches/results/fuzz.json.
#
#   benches/fuzz.sh [--seconds 600] [--jobs 2] [TARGET ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
SECONDS_EACH=600; JOBS=2; TARGETS=()
while [ $# -gt 0 ]; do
    case $1 in
        --seconds) SECONDS_EACH=$2; shift 2 ;;
        --jobs) JOBS=$2; shift 2 ;;
        *) TARGETS+=("$1"); shift ;;
    esac
done
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(safetensors_header manifest config_json session tokenizer)
cd "$repo/fuzz"
cargo +nightly fuzz build -O >&2
work=$(mktemp -d)
run_one() {
    local t=$1
    mkdir -p "$work/$t" "corpus/$t"
    cp -r "corpus/$t/." "$work/$t/" 2>/dev/null || true
    # -rss_limit_mb: a parser that allocates from a length field without a cap is a finding.
    cargo +nightly fuzz run -O "$t" "$work/$t" -- -max_total_time="$SECONDS_EACH" \
        -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 > "$work/$t.log" 2>&1 || true
    mkdir -p "$work/$t.min"
    cargo +nightly fuzz run -O "$t" "$work/$t.min" "$work/$t" -- -merge=1 > "$work/$t.merge.log" 2>&1 || true
    rm -rf "corpus/$t" && mkdir -p "corpus/$t" && cp -r "$work/$t.min/." "corpus/$t/"
    echo "$t done" >&2
}
running=0
for t in "${TARGETS[@]}"; do
    run_one "$t" &
    running=$((running + 1))
    if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait
python3 - "$work" "$repo/benches/results/fuzz.json" "$SECONDS_EACH" "${TARGETS[@]}" <<'PY'
import json, os, re, sys, datetime, glob
work, out, secs, targets = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
res = {"benchmark": "cargo fuzz (libFuzzer) on every parser of untrusted bytes",
       "command": "benches/fuzz.sh --seconds %d" % secs,
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
       "cores": os.cpu_count(), "targets": {}}
for t in targets:
    log = open(os.path.join(work, t + ".log"), errors="replace").read()
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    secs_run = re.findall(r"Done (\d+) runs in (\d+) second", log)
    crashed = bool(re.search(r"==\d+==ERROR|panicked at|deadly signal|out-of-memory", log))
    arts = sorted(glob.glob(os.path.join("artifacts", t, "*")))
    res["targets"][t] = {
        "execs": int(runs[-1]) if runs else (int(secs_run[-1][0]) if secs_run else None),
        "seconds": int(secs_run[-1][1]) if secs_run else None,
        "crashed": crashed,
        "artifacts": arts,
        "corpus_files": len(os.listdir(os.path.join("corpus", t))),
        "cov": (re.findall(r"cov: (\d+)", log) or [None])[-1],
        "log_tail": log.strip().splitlines()[-6:],
    }
json.dump(res, open(out, "w"), indent=1)
for t, r in res["targets"].items():
    print(f"{t}: {r['execs']} execs in {r['seconds']} s, crashed={r['crashed']}, corpus {r['corpus_files']} files, cov {r['cov']}")
PY
