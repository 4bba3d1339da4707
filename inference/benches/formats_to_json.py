#!/usr/bin/env python3
"""Turn the stdout of `cargo bench -p deltafin-inference --bench formats` into JSON.

usage: formats_to_json.py BENCH_STDOUT OUT.json "<command>" [note]
Medians (criterion's middle estimate) of throughput; GiB/s = 2^30 bytes/s. Each kernel row
also gets its fraction of the same run's membw/read median at the same thread count.
"""
import json, os, platform, re, subprocess, sys

src, dst, cmd = sys.argv[1], sys.argv[2], sys.argv[3]
note = sys.argv[4] if len(sys.argv) > 4 else ""
unit = {"B/s": 1 / 2**30, "KiB/s": 1 / 2**20, "MiB/s": 1 / 2**10, "GiB/s": 1.0, "TiB/s": 1024.0}
rows, name = [], None
for line in open(src):
    m = re.match(r"^(membw|matvec|matmul\d*)/(\S+)", line)
    if m:
        name = line.split()[0]
        continue
    m = re.search(r"thrpt:\s+\[\s*([\d.]+) (\S+) ([\d.]+) (\S+) ([\d.]+) (\S+)\]", line)
    if m and name:
        lo, med, hi = (float(m.group(i)) * unit[m.group(i + 1)] for i in (1, 3, 5))
        rows.append({"bench": name, "gib_s_median": round(med, 3), "gib_s_ci": [round(lo, 3), round(hi, 3)]})
        name = None
bw = {r["bench"].split("/")[-1]: r["gib_s_median"] for r in rows if r["bench"].startswith("membw/")}
for r in rows:
    if not r["bench"].startswith("membw/"):
        t = r["bench"].split("/")[-1]
        if t in bw:
            r["fraction_of_membw"] = round(r["gib_s_median"] / bw[t], 3)
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
out = {
    "command": cmd,
    "machine": {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "rustc": subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip(),
        "loadavg_at_write": open("/proc/loadavg").read().split()[:3],
    },
    "note": note,
    "membw_gib_s": bw,
    "results": rows,
}
json.dump(out, open(dst, "w"), indent=1)
print(json.dumps(out["membw_gib_s"]), len(rows), "rows")
