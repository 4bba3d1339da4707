#!/usr/bin/env python3
"""Summarise a `deltafin generate --trace FILE` timeline: how a decoded token's drive reads
overlapped its compute.

    benches/trace_overlap.py TRACE [--rate BYTES_PER_S] [--skip N]

Per decoded token (forward passes after the first N, default 3: the prompt and warm-up):
drive busy (a read outstanding), the bytes' transfer time at --rate, drive idle and which
phase of the forward pass it fell in, time the pass waited for reads, how each layer's
experts were found (cached / prefetched / read after the router) and, for paced drives
(--pace-drives), how long the pacer's reads took against their slots.
"""
import argparse
import bisect
import collections
import json

p = argparse.ArgumentParser()
p.add_argument("trace")
p.add_argument("--rate", type=float, default=1 << 30)
p.add_argument("--skip", type=int, default=3)
a = p.parse_args()
ev = [json.loads(line) for line in open(a.trace)]
fw = [e for e in ev if e["kind"] == "forward"][a.skip:]
if not fw:
    raise SystemExit("no decoded forward passes in the trace")
t0, t1, n = fw[0]["start_ns"], fw[-1]["end_ns"], len(fw)
ms = lambda ns: round(ns / n / 1e6, 2)
reads = [e for e in ev if e["kind"].startswith("read_") and e["end_ns"] > t0 and e["start_ns"] < t1]


def union(iv):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(x, y):
    i = j = tot = 0
    while i < len(x) and j < len(y):
        s, e = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        tot += max(0, e - s)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


busy = union([(max(e["start_ns"], t0), min(e["end_ns"], t1)) for e in reads])
busy_ns = sum(e - s for s, e in busy)
idle, prev = [], t0
for s, e in busy:
    if s > prev:
        idle.append([prev, s])
    prev = e
if prev < t1:
    idle.append([prev, t1])
print(f"{n} tokens: {ms(t1 - t0)} ms/token; drive busy {ms(busy_ns)}, "
      f"bytes/rate {round(sum(e['b'] for e in reads) / a.rate / n * 1e3, 2)}, idle {ms(t1 - t0 - busy_ns)}")
for kind in ("read_demand", "read_prefetch"):
    print(f"  {kind}: {round(sum(e['b'] for e in reads if e['kind'] == kind) / n / 1e6, 1)} MB/token")

# Which phase of the forward pass the drive sat idle in (the innermost one; sampled every 20 us).
inner_first = ["stall", "ffn.experts_gate_up", "ffn.experts_act", "ffn.experts_down", "ffn.experts_combine",
               "ffn.router", "ffn.shared", "ffn.latent_proj", "ffn.dense", "predict_next_experts",
               "mixer.in_proj", "mixer.core", "mixer.out_proj", "norm", "residual", "head", "embed",
               "ffn", "mixer", "forward"]
rank = {k: i for i, k in enumerate(inner_first)}
phases = sorted((e for e in ev if e["kind"] in rank and e["start_ns"] < t1 and e["end_ns"] > t0),
                key=lambda e: e["start_ns"])
starts = [e["start_ns"] for e in phases]
longest = max((e["end_ns"] - e["start_ns"] for e in phases), default=0)
where = collections.Counter()
for s, e in idle:
    t = s
    while t < e:
        lo = bisect.bisect_left(starts, t - longest)
        hi = bisect.bisect_right(starts, t)
        inside = [q["kind"] for q in phases[lo:hi] if q["end_ns"] > t]
        where[min(inside, key=rank.get) if inside else "between passes"] += min(20000, e - t)
        t += 20000
print("  drive idle during (ms/token):", {k: ms(v) for k, v in where.most_common() if ms(v) > 0})
stall = union([(e["start_ns"], e["end_ns"]) for e in ev if e["kind"] == "stall" and t0 <= e["start_ns"] < t1])
print(f"  waiting for reads {ms(sum(e - s for s, e in stall))} ms/token, of which with the drive idle "
      f"{ms(overlap(stall, idle))}")
b = [e["b"] for e in ev if e["kind"] == "batch" and t0 <= e["start_ns"] < t1]
if b:
    avg = lambda f: round(sum(map(f, b)) / len(b), 2)
    print(f"  per MoE layer: {avg(lambda x: x & 0xffff)} experts cached, {avg(lambda x: (x >> 16) & 0xffff)} "
          f"in flight (prefetched), {avg(lambda x: x >> 32)} read after the router")
q = lambda v, f: round(v[min(len(v) - 1, int(len(v) * f))] / 1e3)
inner = sorted(e["end_ns"] - e["start_ns"] for e in ev if e["kind"] == "pace_inner" and t0 <= e["start_ns"] < t1)
late = sorted(e["end_ns"] - e["start_ns"] for e in ev if e["kind"] == "pace_sleep" and t0 <= e["start_ns"] < t1)
if inner:
    woke = f"; woken after the deadline by {q(late, .1)}/{q(late, .5)}/{q(late, .9)} us" if late else ""
    print(f"  paced reads: the read itself p10/median/p90 {q(inner, .1)}/{q(inner, .5)}/{q(inner, .9)} us{woke}")
    # The pacer's own timeline (paced_backend.rs): each read's slot starts when the drive is free
    # (or when asked, if idle) and lasts its bytes at --rate. A read whose inner read (the
    # emulated drive itself: a loop device) ends after its slot made the drive slower than
    # --rate; "busy with late ends" is the slots' union with those ends, the time the emulated
    # drive really took for the bytes it read.
    free, slots, n_late = 0, [], 0
    for e in sorted((e for e in ev if e["kind"] == "pace_inner"), key=lambda e: e["start_ns"]):
        start = max(free, e["start_ns"])
        free = start + e["a"] / a.rate * 1e9
        if t0 <= e["start_ns"] < t1:
            n_late += e["end_ns"] > free
            slots.append((start, max(free, e["end_ns"])))
    took = sum(e - s for s, e in union(slots))
    print(f"  paced reads ending after their slot: {n_late} of {len(slots)}; drive busy with late ends "
          f"{ms(took)} ms/token (decode / that: {round((t1 - t0) / took, 3)})")
