#!/usr/bin/env python3
"""Issue 6 benchmark: speculative decoding with the replay drafter on a streamed (layout) model,
tokens/s against per-token acceptance (1 - corruption) and k (adaptive and fixed), against plain
decoding; and the TTFT of a 512-token prompt + 16 new tokens from a saved session vs cold.

    benches/speculative.py MANIFEST [--ram-budget 700M] [--new 48] [--out benches/results/speculative.json]

Uses target/release/deltafin (or $DELTAFIN_BIN). Greedy outputs are checked to be identical to
plain decoding in every run.
"""
import argparse, json, os, subprocess, sys, tempfile, time

ap = argparse.ArgumentParser()
ap.add_argument("manifest")
ap.add_argument("--ram-budget", default="700M")
ap.add_argument("--new", type=int, default=48)
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--out", default="benches/results/speculative.json")
ap.add_argument("--ks", default="adaptive,2,4,8",
                help="k values to run (adaptive or a number), comma-separated")
ap.add_argument("--snapshot-only", action="store_true",
                help="only the snapshot TTFT measurement, written into the existing --out file")
ap.add_argument("--merge", action="store_true",
                help="replace only the rows run now in an existing --out file (same baseline run "
                     "repeated) and keep its other rows and snapshot figures")
a = ap.parse_args()
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
bin_ = os.environ.get("DELTAFIN_BIN", os.path.join(repo, "target/release/deltafin"))


def run(extra, prompt, new):
    cmd = [bin_, "generate", "--model", a.manifest, "--prompt-ids", ",".join(map(str, prompt)),
           "-n", str(new), "--ignore-eos", "-q", "--json", "--ram-budget", a.ram_budget] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def best(extra, prompt, new):
    """Median-of-repeats by tokens/s (runs alternate with others, so noise is shared)."""
    rs = [run(extra, prompt, new)[0] for _ in range(a.repeats)]
    rs.sort(key=lambda r: r["tokens_per_s"])
    return rs[len(rs) // 2]


def snapshot_figures():
    """Cold 512-token prompt with --save-session, then the same prompt + 16 new tokens."""
    long_prompt = [(i * 53 + 7) % 4000 for i in range(512)]
    with tempfile.TemporaryDirectory() as d:
        snap = os.path.join(d, "s.dfsnap")
        cold, _ = run(["--save-session", snap], long_prompt, 16)
        warm, err = run(["--load-session", snap], long_prompt, 16)
        assert warm["token_ids"] == cold["token_ids"], "warm output differs from cold"
        size = os.path.getsize(snap)
    return {
        "prompt_tokens": 512, "new_tokens": 16, "file_bytes": size,
        "cold_ttft_s": cold["ttft_s"], "warm_ttft_s": warm["ttft_s"],
        "warm_over_cold": warm["ttft_s"] / cold["ttft_s"],
        "snapshot_save_s": cold.get("snapshot_save_s"),
        "snapshot_load_s": warm.get("snapshot_load_s"),
        "prefix_reused_tokens": warm.get("prefix_reused_tokens"),
        "command": " ".join(["benches/speculative.py"] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


if a.snapshot_only:
    path = os.path.join(repo, a.out)
    prev = json.load(open(path)) if os.path.exists(path) else {}
    prev["snapshot"] = snapshot_figures()
    prev.pop("snapshot_error", None)
    with open(path, "w") as f:
        json.dump(prev, f, indent=1)
    print(json.dumps(prev["snapshot"]), file=sys.stderr)
    sys.exit(0)

prompt = [(i * 37 + 11) % 4000 for i in range(32)]
base = best([], prompt, a.new)
want = base["token_ids"]
rows = []
for corruption in [1.0, 0.5, 0.2, 0.0]:
    for k in [k if k == "adaptive" else int(k) for k in a.ks.split(",")]:
        extra = ["--draft", "replay", "--replay-ids", ",".join(map(str, want)),
                 "--replay-corruption", str(corruption)]
        extra += ["--draft-k", "8"] if k == "adaptive" else ["--draft-k", str(k), "--fixed-k"]
        r = best(extra, prompt, a.new)
        assert r["token_ids"] == want, f"output differs at corruption {corruption} k {k}"
        rows.append({
            "per_token_acceptance": round(1 - corruption, 3), "k": k,
            "tokens_per_s": r["tokens_per_s"],
            "speedup": r["tokens_per_s"] / base["tokens_per_s"],
            "acceptance_rate": r["acceptance_rate"], "draft_tokens": r["draft_tokens"],
            "accepted_tokens": r["accepted_tokens"], "verify_passes": r["verify_passes"],
            "plain_decode_steps": r["plain_decode_steps"],
            "bytes_read_per_verify": r["bytes_read_per_verify"],
            "bytes_read_per_token": r.get("bytes_read_per_token"),
            "k_histogram": r["draft_k_histogram"],
        })
        print(json.dumps(rows[-1]), file=sys.stderr)

if a.merge:
    path = os.path.join(repo, a.out)
    prev = json.load(open(path))
    ran = {(r["per_token_acceptance"], r["k"]) for r in rows}
    kept = [r for r in prev["replay"] if (r["per_token_acceptance"], r["k"]) not in ran]
    for r in rows:
        # Speedups stay relative to this run's own baseline.
        r["baseline_tokens_per_s"] = base["tokens_per_s"]
    prev["replay"] = sorted(kept + rows, key=lambda r: (-r["per_token_acceptance"], str(r["k"])))
    prev.setdefault("merged_runs", []).append({
        "command": " ".join(["benches/speculative.py"] + sys.argv[1:]),
        "baseline_tokens_per_s": base["tokens_per_s"],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S")})
    with open(path, "w") as f:
        json.dump(prev, f, indent=1)
    sys.exit(0)

snapshot = snapshot_figures()

out = {
    "command": " ".join(["benches/speculative.py"] + sys.argv[1:]),
    "model": base.get("model"), "layout": base.get("layout"), "machine": base.get("machine"),
    "ram_budget": a.ram_budget, "new_tokens": a.new, "prompt_tokens": len(prompt),
    "baseline": {"tokens_per_s": base["tokens_per_s"],
                 "bytes_read_per_token": base.get("bytes_read_per_token"),
                 "ttft_s": base["ttft_s"]},
    "replay": rows,
    "snapshot": snapshot,
    "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
}
os.makedirs(os.path.dirname(os.path.join(repo, a.out)), exist_ok=True)
with open(os.path.join(repo, a.out), "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps(out["snapshot"]), file=sys.stderr)
