#!/usr/bin/env python3
"""Ask the demo model three questions through chat completions, the Responses API and Ollama's /api/chat, and make
one tool round trip through chat completions (a `lookup_docs` call, then the answer from its result), against a
running `deltafin serve` on the demo store. Greedy; standard library only.

    deltafin convert --from models/k3-demo/hf --to /tmp/demo && deltafin serve -m /tmp/demo --port 8392 &
    python3 tools/demo/ask_server.py 8392 > bench-results/demo-chat/server-answers.txt
"""

import json
import sys
import urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
def post(path, body):
    r = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(r))
M = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
for q in ["What does `os.path.join` do in Python?", "What is `Vec::push` used for in Rust?", "How do I use `str.split` in Python?"]:
    a = post("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": q}], "max_tokens": 200, "temperature": 0})
    b = post("/v1/responses", {"model": M, "input": q, "max_output_tokens": 200, "temperature": 0})
    c = post("/api/chat", {"model": M, "messages": [{"role": "user", "content": q}], "stream": False, "options": {"temperature": 0, "num_predict": 200}})
    print("Q:", q)
    print("  chat completions reasoning_content:", json.dumps(a["choices"][0]["message"].get("reasoning_content")))
    print("  chat completions content:", json.dumps(a["choices"][0]["message"]["content"]))
    print("  Responses output_text:   ", json.dumps([o for o in b["output"] if o["type"] == "message"][0]["content"][0]["text"]))
    print("  /api/chat content:       ", json.dumps(c["message"]["content"]))
tool = {"type": "function", "function": {"name": "lookup_docs", "description": "Look up the reference documentation of a Python or Rust name.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string", "description": "The qualified name, e.g. os.path.join or Vec::push."},
        "language": {"type": "string", "enum": ["python", "rust"]}}, "required": ["name", "language"]}}}
msgs = [{"role": "user", "content": "What does `shutil.copyfile` do in Python?"}]
a = post("/v1/chat/completions", {"model": M, "messages": msgs, "tools": [tool], "max_tokens": 200, "temperature": 0})
m = a["choices"][0]["message"]
print("Tool round trip: finish_reason", a["choices"][0]["finish_reason"], "tool_calls", json.dumps(m.get("tool_calls")))
msgs.append(m)
msgs.append({"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": "shutil.copyfile(src, dst, *, follow_symlinks=True)\n\nCopy the contents (no metadata) of the file named src to a file named dst and return dst in the most efficient way possible."})
a = post("/v1/chat/completions", {"model": M, "messages": msgs, "tools": [tool], "max_tokens": 200, "temperature": 0})
print("  answer after the tool result:", json.dumps(a["choices"][0]["message"]["content"]))
