#!/usr/bin/env bash
# Issue 14: deltafin and llama.cpp side by side on the same synthetic model, in RAM, 2 threads.
#
# llama.cpp: the CPU build of the tree the PyPI sdist of llama-cpp-python $LLAMA_CPP_PYTHON
# vendors (0.3.36 -> llama.cpp 0c1e570), built once into $LLAMA_DIR (llama-bench,
# llama-quantize). The model: a DeepSeek-V3-shaped synth (hidden 1024, 16 layers, 128 experts
# top-8, expert width 512: 3.1B parameters), written by `deltafin synth` in each format, and as
# GGUF by benches/hf_to_gguf.py (bf16, tensors identical to llama.cpp's own converter) then
# llama-quantize (Q8_0, Q4_K_M; and experts-only variants with the rest BF16). Each GGUF is
# paired with the deltafin checkpoint quantized the same way: `synth --format F` (experts only)
# and `synth --format F --quantize-dense F --quantize-head q8` (every projection, lm_head
# in Q8: llama.cpp's Q8_0 stores output.weight in Q8_0, its Q4_K_M in Q6_K). Decode: tokens/s generating --decode tokens after a 1-token prompt (llama-bench tg);
# prefill: a --prompt-token prompt (llama-bench pp). Both measured the way llama-bench does it:
# model loaded once, an untimed warm-up run, then timed runs (deltafin: `bench compute`).
# Medians of --runs, and the median of per-run ratios (engines measured back to back);
# writes benches/results/$OUT_NAME.json and, with deltafin-plot, $OUT_NAME.svg (OUT_NAME:
# vs_llamacpp unless set; e.g. OUT_NAME=vs_llamacpp_pp512 for a --prompt 512 run).
#
#   benches/vs_llamacpp.sh [--runs 3] [--decode 64] [--prompt 32] [--formats bf16,q8,int4]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
ORIG_ARGS="$*"
RUNS=3; DECODE=64; PROMPT=32; FORMATS=bf16,q8,int4
while [ $# -gt 0 ]; do
    case $1 in
        --runs) RUNS=$2; shift 2 ;;
        --decode) DECODE=$2; shift 2 ;;
        --prompt) PROMPT=$2; shift 2 ;;
        --formats) FORMATS=$2; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}
OUT_NAME=${OUT_NAME:-vs_llamacpp}
LLAMA_DIR=${LLAMA_DIR:-/var/tmp/deltafin-llamacpp/$LLAMA_CPP_PYTHON}
work=${BENCH_WORK:-/var/tmp/deltafin-bench-model}/vs-llamacpp
mkdir -p "$work" "$LLAMA_DIR"

# --- llama.cpp, built once -------------------------------------------------------------
src="$LLAMA_DIR/src/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp"
if [ ! -x "$LLAMA_DIR/build/bin/llama-bench" ]; then
    python3 -m pip install -q scikit-build-core cmake ninja
    if [ ! -d "$src" ]; then
        # --no-build-isolation: otherwise pip builds cmake and ninja from source to read metadata.
        python3 -m pip download -q "llama-cpp-python==$LLAMA_CPP_PYTHON" --no-deps \
            --no-binary :all: --no-build-isolation -d "$LLAMA_DIR/sdist"
        mkdir -p "$LLAMA_DIR/src"
        tar xzf "$LLAMA_DIR/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$LLAMA_DIR/src"
    fi
    cmake -S "$src" -B "$LLAMA_DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_CCACHE=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF >&2
    cmake --build "$LLAMA_DIR/build" -j"$(nproc)" --target llama-bench llama-quantize >&2
fi
python3 -c 'import gguf' 2>/dev/null || python3 -m pip install -q "$src/gguf-py"
lbin="$LLAMA_DIR/build/bin"

# --- deltafin ----------------------------------------------------------------------------
bin=${DELTAFIN_BIN:-}
if [ -z "$bin" ]; then
    cargo build --release -p deltafin --manifest-path "$repo/Cargo.toml" >&2
    bin="$repo/target/release/deltafin"
fi

# --- the model in every format -------------------------------------------------------------
shape=(--preset medium --set num_hidden_layers=16 --set n_routed_experts=128
       --set num_experts_per_tok=8 --set moe_intermediate_size=512 --seed 7)
declare -A synth_fmt=([bf16]=bf16 [q8]=q8 [int4]=int4)
declare -A gguf_type=([bf16]="" [q8]=Q8_0 [int4]=Q4_K_M)
declare -A expert_type=([q8]=q8_0 [int4]=q4_K)
IFS=, read -r -a formats <<< "$FORMATS"
for f in "${formats[@]}"; do
    d="$work/ds-$f"
    [ -f "$d/config.json" ] || "$bin" synth --out "$d" "${shape[@]}" --format "${synth_fmt[$f]}" --force -q
    # Every non-expert projection quantized too (synth --quantize-dense), as llama.cpp's
    # Q8_0 / Q4_K_M quantize them: the like-for-like pair of the full GGUF.
    # lm_head too, in Q8 (the GGUFs' output.weight: Q8_0 in Q8_0, Q6_K in Q4_K_M).
    [ "$f" = bf16 ] || [ -f "$d-dense-q8head/config.json" ] || "$bin" synth --out "$d-dense-q8head" \
        "${shape[@]}" --format "${synth_fmt[$f]}" --quantize-dense "${synth_fmt[$f]}" \
        --quantize-head q8 --force -q
done
g16="$work/ds-bf16.gguf"
[ -f "$g16" ] || { [ -f "$work/ds-bf16/config.json" ] || "$bin" synth --out "$work/ds-bf16" "${shape[@]}" --force -q;
                   python3 "$here/hf_to_gguf.py" "$work/ds-bf16" "$g16"; }
for f in "${formats[@]}"; do
    t=${gguf_type[$f]}
    [ -z "$t" ] && continue
    [ -f "$work/ds-$f.gguf" ] || "$lbin/llama-quantize" "$g16" "$work/ds-$f.gguf" "$t" 2 >&2
    # Experts only, the rest BF16: what deltafin's synth --format does.
    [ -f "$work/ds-$f-experts.gguf" ] || "$lbin/llama-quantize" \
        --tensor-type "ffn_(gate|up|down)_exps=${expert_type[$f]}" --tensor-type ".=bf16" \
        --token-embedding-type bf16 --output-tensor-type bf16 \
        "$g16" "$work/ds-$f-experts.gguf" "$t" 2 >&2
done

# --- runs -----------------------------------------------------------------------------------
raw=$(mktemp)
: > "$raw"
prompt_ids=$(python3 -c "import random; r=random.Random(1); print(','.join(str(r.randrange(2, 8000)) for _ in range($PROMPT)))")
# Format by format, so that each one's files are in the page cache while it is measured (all
# of them together do not fit this machine's RAM): a warm-up read first, then the runs.
for f in "${formats[@]}"; do
    # (deltafin model dir, GGUF, deltafin activations) triples: experts-only quantization on
    # both sides, then everything quantized on both sides. Each twice: deltafin's default
    # activations (BF16: exact f32; INT4/Q8: 16 bits per 32 values) and the precision llama.cpp
    # itself uses, opt-in in deltafin (BF16: DELTAFIN_ACTIVATIONS=bf16, rounded to BF16 for
    # vdpbf16ps; INT4/Q8: DELTAFIN_ACTIVATIONS=i8, 8 bits per 32 values): the like-for-like pair.
    # The experts-only models keep BF16 attention, dense and head matrices, whose inputs
    # llama.cpp rounds to BF16 too: their like-for-like cell is `i8,bf16` (until session 38 it
    # was `i8`, which left those matrices on exact f32 inputs).
    if [ "$f" = bf16 ]; then
        pairs=("$work/ds-bf16|$g16|default" "$work/ds-bf16|$g16|bf16")
    else
        pairs=()
        for a in default i8; do
            ea=$a; [ "$a" = i8 ] && ea=i8,bf16
            pairs+=("$work/ds-$f|$work/ds-$f-experts.gguf|$ea" "$work/ds-$f-dense-q8head|$work/ds-$f.gguf|$a")
        done
    fi
    for pair in "${pairs[@]}"; do
    IFS='|' read -r d g act <<< "$pair"
    acts_env=()
    [ "$act" = default ] || acts_env=(env "DELTAFIN_ACTIVATIONS=$act")
    # Both engines' files into the page cache (each engine maps them; "in RAM" means this).
    cat "$d"/*.safetensors "$g" > /dev/null
    for ((r = 0; r < RUNS; r++)); do
        # llama-bench warms up itself (one untimed run) before each test.
        # On CPUs with AMX, llama.cpp's default weight repacking puts Q8_0 / Q4_K projections
        # into its AMX buffer, and on this model's all-quantized GGUFs its scheduler then
        # aborts (ggml-backend.cpp: GGML_ASSERT(*cur_backend_id != -1)). A user would then run
        # it with --repack 0, so the script does, says so, and records it per row.
        repack=1
        if ! "$lbin/llama-bench" -m "$g" -t 2 -p "$PROMPT" -n "$DECODE" -r 1 -o jsonl > "$raw.lb" 2> "$raw.lberr"; then
            echo "llama-bench failed on $g ($(grep -m1 -o 'GGML_ASSERT.*' "$raw.lberr" || tail -c 200 "$raw.lberr")); again with --repack 0" >&2
            repack=0
            "$lbin/llama-bench" -m "$g" -t 2 -p "$PROMPT" -n "$DECODE" -r 1 --repack 0 -o jsonl > "$raw.lb"
        fi
        python3 -c "
import json, sys
for l in sys.stdin:
    if not l.startswith('{'):
        continue  # llama-bench's own messages on stdout
    x = json.loads(l)
    kind = 'prefill' if x['n_prompt'] > 0 else 'decode'
    print(json.dumps({'engine': 'llama.cpp', 'format': '$f', 'pair': '$(basename "$g")', 'variant': '$act', 'run': $r, 'kind': kind,
                      'tokens_per_s': x['avg_ts'], 'cpu_info': x.get('cpu_info'),
                      'model_type': x.get('model_type'), 'n_threads': x.get('n_threads'), 'repack': $repack == 1}))" < "$raw.lb" >> "$raw"
        # deltafin: the same measurement in one process (`bench compute`: load, one untimed
        # warm-up generation, then a fresh session for prefill and one for decode).
        "${acts_env[@]}" "$bin" bench compute "$d" --prompt "$PROMPT" --decode "$DECODE" --runs 1 --json 2>/dev/null |
            tail -1 | python3 -c "
import json, sys
x = json.loads(sys.stdin.read())
for kind, key in (('decode', 'decode_tokens_per_s_median'), ('prefill', 'prefill_tokens_per_s_median')):
    print(json.dumps({'engine': 'deltafin', 'format': '$f', 'pair': '$(basename "$g")', 'dir': '$(basename "$d")', 'variant': '$act',
                      'run': $r, 'kind': kind, 'tokens_per_s': x[key], 'kernels': x.get('kernels')}))" >> "$raw"
    done
    done
done
BENCH_CMD="benches/vs_llamacpp.sh $ORIG_ARGS" python3 - "$raw" "$repo/benches/results/$OUT_NAME.json" \
    "$LLAMA_CPP_PYTHON" "$PROMPT" "$DECODE" <<'PY'
import json, os, sys, statistics, datetime, platform, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
groups = collections.defaultdict(list)
for x in rows:
    groups[(x["format"], x["kind"], x["pair"], x.get("variant", "default"), x["engine"])].append(x)
table = []
for fmt in ["bf16", "q8", "int4"]:
    for kind in ["decode", "prefill"]:
        for pair, variant in sorted({k[2:4] for k in groups if k[:2] == (fmt, kind)}):
            ours = groups.get((fmt, kind, pair, variant, "deltafin"))
            theirs = groups.get((fmt, kind, pair, variant, "llama.cpp"))
            if not ours or not theirs:
                continue
            om = statistics.median(x["tokens_per_s"] for x in ours)
            tm = statistics.median(x["tokens_per_s"] for x in theirs)
            # Paired by run (the two engines measured back to back): this shared host's
            # memory bandwidth drifts between runs more than the differences measured.
            o = {x["run"]: x["tokens_per_s"] for x in ours}
            t = {x["run"]: x["tokens_per_s"] for x in theirs}
            paired = [o[r] / t[r] for r in sorted(o) if r in t]
            table.append({"format": fmt, "kind": kind, "llama_cpp_file": pair, "deltafin_dir": ours[0]["dir"],
                          "deltafin_activations": variant,
                          "deltafin_tokens_per_s": om, "llama_cpp_tokens_per_s": tm,
                          "ratio_of_medians": om / tm,
                          "ratio": statistics.median(paired), "paired_ratios": paired})
cpu = next((x.get("cpu_info") for x in rows if x.get("cpu_info")), None)
flags = open("/proc/cpuinfo").read()
isas = [f for f in ["avx512_vnni", "avx512_bf16", "avx512f", "avx_vnni", "avx2", "fma", "amx_tile"]
        if f" {f}" in flags]
out = {"benchmark": "deltafin vs llama.cpp in RAM, 2 threads, same synthetic model",
       "command": os.environ.get("BENCH_CMD"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
       "machine": {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "cpu_flags": isas},
       "llama_cpp": f"llama-cpp-python {sys.argv[3]} sdist (vendored llama.cpp 0c1e570), GGML_NATIVE, OpenMP",
       "model": "deepseek_v3 synth medium: hidden 1024, 16 layers, 128 experts top-8, expert width 512",
       "prompt_tokens": int(sys.argv[4]), "decode_tokens": int(sys.argv[5]),
       "table": table, "runs": rows}
json.dump(out, open(sys.argv[2], "w"), indent=1)
for t in table:
    print(f"{t['format']:5} {t['kind']:7} {t['deltafin_dir']:14} {t['deltafin_activations']:11} vs {t['llama_cpp_file']:22} deltafin {t['deltafin_tokens_per_s']:7.2f}  "
          f"llama.cpp {t['llama_cpp_tokens_per_s']:7.2f}  paired ratio {t['ratio']:.2f} "
          f"({min(t['paired_ratios']):.2f}-{max(t['paired_ratios']):.2f})")
PY
rm -f "$raw" "$raw.lb" "$raw.lberr"
# The plot beside the JSON: bars of the paired ratios.
plot="$repo/target/release/deltafin-plot"
[ -x "$plot" ] || cargo build --release -p deltafin --bin deltafin-plot --manifest-path "$repo/Cargo.toml" >&2
"$plot" "$repo/benches/results/$OUT_NAME.json" "$repo/benches/results/$OUT_NAME.svg"
