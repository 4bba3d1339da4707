"""The official `openai` Python client against `deltafin serve` (run by .ci/run).

On a synthetic model with a real tokenizer and chat template, the client lists the model,
completes a chat, streams it, runs a text completion and a second turn; every reply must equal
what `deltafin generate` gives greedily for the same rendered prompt, token for token (the
texts of the same ids, and the same counts). The server is started here and stopped at the end.

    pip install openai
    python3 tools/tests/openai_client.py --bin target/debug/deltafin
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import openai

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
N = 24  # tokens per reply


def run(bin_, *args):
    out = subprocess.run([bin_, *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"deltafin {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def make_model(bin_, d):
    # The HF test tokenizer has 606 ids; [EOS] is 1, as the synth config says.
    run(bin_, "synth", "--out", d, "--preset", "tiny", "--set", "vocab_size=606", "--force", "-q")
    shutil.copy(os.path.join(REPO, "testdata/tokenizers/hf/tokenizer.json"), d)
    shutil.copy(os.path.join(REPO, "testdata/chat_templates/kimi_k2_instruct.jinja"),
                os.path.join(d, "chat_template.jinja"))


def reference(bin_, model, messages, tmp):
    """`deltafin template` then `deltafin generate` greedy, N tokens, EOS ignored."""
    inputs = os.path.join(tmp, "inputs.json")
    with open(inputs, "w") as f:
        json.dump({"messages": messages, "add_generation_prompt": True}, f)
    prompt = run(bin_, "template", "--model", model, "--inputs", inputs)
    return generate(bin_, model, prompt)


def generate(bin_, model, prompt):
    out = run(bin_, "generate", "--model", model, "--prompt", prompt, "-n", str(N),
              "--ignore-eos", "--json", "-q")
    return json.loads(out.strip().splitlines()[-1])


def start_server(bin_, model):
    p = subprocess.Popen([bin_, "serve", "--model", model, "--port", "0", "-q"],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stderr.readline()
        if not line:
            sys.exit(f"the server exited: {p.wait()}")
        m = re.search(r"on (http://\S+)", line)
        if m:
            return p, m.group(1)
    sys.exit("the server did not start in 120 s")


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "target/debug/deltafin"))
    bin_ = ap.parse_args().bin
    tmp = tempfile.mkdtemp(prefix="deltafin-openai-")
    model = os.path.join(tmp, "chatmodel")
    make_model(bin_, model)
    server, base = start_server(bin_, model)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        names = [m.id for m in client.models.list().data]
        check(names == ["chatmodel"], f"models.list() names the model ({names})")

        messages = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Write a haiku about NVMe drives, 3 lines."}]
        ref = reference(bin_, model, messages, tmp)
        extra = {"ignore_eos": True}
        r = client.chat.completions.create(model="chatmodel", messages=messages, max_tokens=N,
                                           temperature=0, extra_body=extra)
        content = r.choices[0].message.content
        check(content == ref["text"], f"chat completion equals `deltafin generate` ({content!r})")
        check(r.usage.prompt_tokens == ref["prompt_tokens"]
              and r.usage.completion_tokens == len(ref["token_ids"]) == N,
              f"usage counts the same tokens ({r.usage.prompt_tokens} + {r.usage.completion_tokens})")
        check(r.choices[0].finish_reason == "length", "finish_reason is length")

        stream = client.chat.completions.create(model="chatmodel", messages=messages, max_tokens=N,
                                                temperature=0, stream=True, extra_body=extra,
                                                stream_options={"include_usage": True})
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    pieces.append(c.delta.content)
                finish = c.finish_reason or finish
        check("".join(pieces) == ref["text"],
              f"streamed chat equals `deltafin generate` in {len(pieces)} pieces")
        check(finish == "length" and usage is not None and usage.completion_tokens == N,
              "the stream ends with finish_reason and usage")
        # The same conversation again: its state was kept, so the prompt is not prefilled again.
        reused = (usage.prompt_tokens_details.cached_tokens
                  if usage.prompt_tokens_details else 0)
        check(reused >= usage.prompt_tokens - 1,
              f"a repeated prompt reuses the kept state ({reused} of {usage.prompt_tokens})")

        # A second turn prefills only its new tokens.
        turn2 = messages + [{"role": "assistant", "content": content},
                            {"role": "user", "content": "Now one about RAM."}]
        ref2 = reference(bin_, model, turn2, tmp)
        r2 = client.chat.completions.create(model="chatmodel", messages=turn2, max_tokens=N,
                                            temperature=0, extra_body=extra)
        cached = r2.usage.prompt_tokens_details.cached_tokens
        check(r2.choices[0].message.content == ref2["text"], "second turn equals `deltafin generate`")
        check(0 < cached < r2.usage.prompt_tokens,
              f"second turn reused {cached} of {r2.usage.prompt_tokens} prompt tokens")

        prompt = "fn main() {\n    println!(\"héllo\");"
        ref3 = generate(bin_, model, prompt)
        c = client.completions.create(model="chatmodel", prompt=prompt, max_tokens=N,
                                      temperature=0, extra_body=extra)
        check(c.choices[0].text == ref3["text"], "text completion equals `deltafin generate`")

        # Sampling with a seed is repeatable.
        a = client.chat.completions.create(model="chatmodel", messages=messages, max_tokens=N,
                                           temperature=0.9, top_p=0.95, seed=7, extra_body=extra)
        b = client.chat.completions.create(model="chatmodel", messages=messages, max_tokens=N,
                                           temperature=0.9, top_p=0.95, seed=7, extra_body=extra)
        check(a.choices[0].message.content == b.choices[0].message.content,
              "seeded sampling repeats")

        # Errors are OpenAI errors the client understands.
        try:
            client.chat.completions.create(model="nope", messages=messages, max_tokens=4)
            check(False, "an unknown model is refused")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and "nope" in str(e), "an unknown model is a 400")
        try:
            client.chat.completions.create(model="chatmodel", messages=messages, max_tokens=10**6)
            check(False, "a context overflow is refused")
        except openai.BadRequestError as e:
            check("context" in str(e), "a context overflow is a 400")
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
