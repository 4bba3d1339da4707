"""Extra chat-template references beyond shared/chat_templates: tools, tool calls and tool
results, reasoning history, whitespace, Unicode, template variables. Rendered with the same
function transformers' apply_chat_template uses (render_jinja_template, transformers 5.24.0).

    pip install transformers==5.24.0 jinja2
    python3 make_references.py   # writes references_extra.json next to this file
"""
import json
import os

from transformers.utils.chat_template_utils import render_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "..")
NAMES = ["kimi_k3", "kimi_k2_instruct", "kimi_k2_thinking", "deepseek_v3_1", "qwen3"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city. Returns °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "default": 1.5},
            },
            "required": ["city"],
        },
    },
}

CASES = {
    "tools_offered": {
        "messages": [{"role": "user", "content": "Weather in Zürich?"}],
        "tools": [WEATHER],
        "add_generation_prompt": True,
    },
    "tool_call_and_result": {
        "messages": [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "functions.get_weather:0",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather", "content": "{\"temp\": 18}"},
        ],
        "tools": [WEATHER],
        "add_generation_prompt": True,
    },
    "reasoning_history": {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
            {"role": "user", "content": "And 3+3?"},
        ],
        "add_generation_prompt": True,
    },
    "whitespace_and_unicode": {
        "messages": [
            {"role": "system", "content": "  Be brief.\n\n"},
            {"role": "user", "content": "\tCafé ☕ — 東京?  \n"},
            {"role": "assistant", "content": "  Oui.  "},
            {"role": "user", "content": ""},
        ],
        "add_generation_prompt": True,
    },
    "thinking_off": {
        "messages": [{"role": "user", "content": "Hi"}],
        "add_generation_prompt": True,
        "thinking": False,
        "enable_thinking": False,
    },
    "continue_without_prompt": {
        "messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "Hi!"},
        ],
        "add_generation_prompt": False,
    },
}


def main():
    out = {}
    for name in NAMES:
        src = open(os.path.join(TEMPLATES, name + ".jinja")).read()
        out[name] = {}
        for case, inputs in CASES.items():
            inputs = dict(inputs, bos_token="[BOS]", eos_token="[EOS]")
            kwargs = {k: v for k, v in inputs.items() if k not in ("messages", "tools", "add_generation_prompt")}
            try:
                rendered = render_jinja_template(
                    conversations=[inputs["messages"]],
                    tools=inputs.get("tools"),
                    chat_template=src,
                    add_generation_prompt=inputs["add_generation_prompt"],
                    **kwargs,
                )
                if isinstance(rendered, tuple):
                    rendered = rendered[0]
                if isinstance(rendered, list):
                    rendered = rendered[0]
                out[name][case] = {"inputs": inputs, "rendered": rendered}
            except Exception as e:  # the template refuses these inputs: so must we
                out[name][case] = {"inputs": inputs, "error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(HERE, "references_extra.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    for name, cases in out.items():
        print(name, {c: ("error" if "error" in v else len(v["rendered"])) for c, v in cases.items()})


if __name__ == "__main__":
    main()
