#!/usr/bin/env bash
# Issue 15: does a follow-up turn prefill only its new tokens? `deltafin serve` over a streamed
# layout (the medium deepseek_v3 synth with the test tokenizer, striped over N emulated drives,
# each throttled, RAM budget below the experts' size). Per round, a fresh conversation:
#   turn 1 (long document + question), then turn 2 twice: cold (`cache_prompt: false`, the
#   whole prompt prefilled) and warm (reusing turn 1's kept state); then the server restarts
#   and turn 3 runs warm from the on-disk snapshot (--snapshot-dir) and cold.
# Time to first token is measured by the client (request sent -> first streamed content).
# Greedy replies of warm and cold runs must be identical. Medians over rounds; writes
# benches/results/serve_reuse.json.
#
#   sudo benches/serve_reuse.sh [--rounds 3] [--drives 4] [--ram-budget 700M] [--bps 157286400]
#                               [--words 250]   (turn 1's document: 250 words ~ 1400 tokens)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
ROUNDS=3; N=4; BUDGET=700M; BPS=$((150 * 1024 * 1024)); WORDS=250
while [ $# -gt 0 ]; do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --drives) N=$2; shift 2 ;;
        --ram-budget) BUDGET=$2; shift 2 ;;
        --bps) BPS=$2; shift 2 ;;
        --words) WORDS=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
source "$here/emulated_drives.sh"
export BENCH_CMD="benches/serve_reuse.sh $ORIG_ARGS"
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}
model="$work/medium-chat"
if [ ! -f "$model/config.json" ]; then
    "$bin" synth --out "$model" --preset medium --set vocab_size=606 --seed 1 --force -q
fi
cp "$repo/testdata/tokenizers/hf/tokenizer.json" "$model/"
cp "$repo/testdata/chat_templates/kimi_k2_instruct.jinja" "$model/chat_template.jinja"
model_bytes=$(du -sb "$model" | cut -f1)
drives_setup "$N" $(( model_bytes / 1000000000 + 2 )) "$BPS"
args=()
for ((i = 0; i < N; i++)); do args+=(--drive "$BENCH_MNT/d$i"); done
"$bin" layout --model "$model" "${args[@]}" --name chat --force -q >&2
snapdir=$(mktemp -d)
log=$(mktemp)
start_server() {
    drop_caches
    in_throttled "$bin" serve --model "$BENCH_MNT/d0/chat" --port 0 --ram-budget "$BUDGET" \
        --snapshot-dir "$snapdir" -q 2> "$log" &
    server_pid=$!
    for _ in $(seq 600); do
        addr=$(grep -o 'http://[0-9.:]*' "$log" | head -1 || true)
        [ -n "$addr" ] && return 0
        kill -0 "$server_pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.5
    done
    echo "the server did not start" >&2; exit 1
}
# The server runs under in_throttled's shell: stop it by its command line.
stop_server() {
    pkill -f -- "--snapshot-dir $snapdir" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
}
trap 'stop_server; drives_teardown' EXIT
results=$(mktemp)
: > "$results"
for ((r = 0; r < ROUNDS; r++)); do
    start_server
    python3 "$here/serve_reuse_client.py" --base "$addr" --round "$r" --phase 1 --words "$WORDS" --state "$snapdir/round$r.json" >> "$results"
    stop_server
    start_server
    python3 "$here/serve_reuse_client.py" --base "$addr" --round "$r" --phase 2 --state "$snapdir/round$r.json" >> "$results"
    stop_server
done
WORDS=$WORDS python3 - "$results" "$repo/benches/results/serve_reuse${OUT_SUFFIX:-}.json" "$N" "$BPS" "$BUDGET" <<'PY'
import json, sys, statistics, datetime, os, platform
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def med(key, phase):
    v = [x[key] for x in rows if x["phase"] == phase and x.get(key) is not None]
    return statistics.median(v) if v else None
summary = {
    "turn1_prompt_tokens": med("turn1_prompt_tokens", 1),
    "turn1_ttft_s": med("turn1_ttft_s", 1),
    "turn2_prompt_tokens": med("turn2_prompt_tokens", 1),
    "turn2_cold_ttft_s": med("turn2_cold_ttft_s", 1),
    "turn2_warm_ttft_s": med("turn2_warm_ttft_s", 1),
    "turn2_warm_reused_tokens": med("turn2_warm_reused", 1),
    "turn2_cold_over_warm": med("turn2_cold_over_warm", 1),
    "turn3_prompt_tokens": med("turn3_prompt_tokens", 2),
    "turn3_cold_ttft_s": med("turn3_cold_ttft_s", 2),
    "turn3_disk_ttft_s": med("turn3_disk_ttft_s", 2),
    "turn3_disk_reused_tokens": med("turn3_disk_reused", 2),
    "turn3_cold_over_disk": med("turn3_cold_over_disk", 2),
    "replies_identical_warm_and_cold": all(x["identical"] for x in rows),
}
out = {
    "benchmark": "serve: prefix reuse across turns on a streamed layout (client-measured TTFT)",
    "command": os.environ.get("BENCH_CMD", ""),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    "machine": {"cores": os.cpu_count(), "kernel": platform.release()},
    "drives": int(sys.argv[3]), "mode": "stripe", "throttle_bytes_per_s_per_drive": int(sys.argv[4]),
    "ram_budget": sys.argv[5], "model": "medium deepseek_v3 synth, vocab 606, test tokenizer, Kimi K2 template",
    "summary_medians": summary, "rounds": rows,
}
out["words"] = int(os.environ.get("WORDS", "0"))
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps(summary, indent=1))
PY
rm -rf "$snapdir" "$log" "$results"
