"""Client half of benches/serve_reuse.sh: one round's conversation against `deltafin serve`,
printing one JSON line of measurements. Phase 1: turn 1, then turn 2 cold and warm. Phase 2
(after a server restart): turn 3 warm from the on-disk snapshot, then cold."""
import argparse
import http.client
import json
import random
import time
import urllib.parse

WORDS = ("drive stripe expert layer token cache prefetch router latent mirror checksum block "
         "queue thread kernel tensor weight shard record budget memory stream prefill decode "
         "attention gate residual norm vector matrix scale rank head value key query").split()
N = 32


def chat(base, messages, cache_prompt=True):
    """Stream one greedy reply; returns (ttft seconds, text, usage)."""
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    body = json.dumps({"model": "chat", "messages": messages, "max_tokens": N, "temperature": 0,
                       "ignore_eos": True, "stream": True, "cache_prompt": cache_prompt,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read()[:500]!r}")
    ttft, text, usage = None, [], None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices", []):
            piece = c["delta"].get("content") or c["delta"].get("reasoning_content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    conn.close()
    return ttft, "".join(text), usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--phase", type=int, choices=[1, 2], required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--words", type=int, default=250)
    a = ap.parse_args()
    rng = random.Random(a.round)
    out = {"round": a.round, "phase": a.phase}
    if a.phase == 1:
        doc = " ".join(rng.choice(WORDS) for _ in range(a.words))
        msgs = [{"role": "system", "content": f"Session {a.round}. Answer from the notes."},
                {"role": "user", "content": f"Notes:\n{doc}\n\nWhich word comes up most?"}]
        t1, reply1, u1 = chat(a.base, msgs)
        msgs2 = msgs + [{"role": "assistant", "content": reply1},
                        {"role": "user", "content": "And the least? One word."}]
        cold, reply_cold, uc = chat(a.base, msgs2, cache_prompt=False)
        warm, reply_warm, uw = chat(a.base, msgs2)
        out.update(turn1_prompt_tokens=u1["prompt_tokens"], turn1_ttft_s=t1,
                   turn2_prompt_tokens=uw["prompt_tokens"], turn2_cold_ttft_s=cold,
                   turn2_warm_ttft_s=warm, turn2_warm_reused=uw["prompt_tokens_reused"],
                   turn2_cold_reused=uc["prompt_tokens_reused"],
                   turn2_cold_over_warm=cold / warm, identical=reply_cold == reply_warm)
        json.dump({"messages": msgs2 + [{"role": "assistant", "content": reply_warm}]},
                  open(a.state, "w"))
    else:
        msgs3 = json.load(open(a.state))["messages"] + [
            {"role": "user", "content": "Thanks. Now summarise the notes in one line."}]
        disk, reply_disk, ud = chat(a.base, msgs3)
        cold, reply_cold, uc = chat(a.base, msgs3, cache_prompt=False)
        out.update(turn3_prompt_tokens=ud["prompt_tokens"], turn3_disk_ttft_s=disk,
                   turn3_disk_reused=ud["prompt_tokens_reused"], turn3_cold_ttft_s=cold,
                   turn3_cold_over_disk=cold / disk, identical=reply_cold == reply_disk)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
