"""The chat page's conversation state without a browser (issue 41, item 10): chat.js runs in Node with a stub
DOM and a stub fetch; a turn the server refuses (a 400) is dropped from the history, so the next message is
sent without it, and a turn that succeeds stays. (test_chat_page.py drives the page in Chromium.)"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

NODE = shutil.which("node") or shutil.which("nodejs")
CHAT_JS = Path(__file__).resolve().parents[1] / "glmcore" / "server" / "static" / "chat.js"

HARNESS = r"""
const fs = require("fs"), vm = require("vm");
function fake() {
  const store = { value: "", hidden: false, title: "", classList: { add() {}, remove() {}, toggle() {} } };
  return new Proxy(function () {}, {
    get(t, p) {
      if (p in store) return store[p];
      if (p === "querySelectorAll") return () => [];
      return () => fake();
    },
    set(t, p, v) { store[p] = v; return true; },
  });
}
const ids = {};
const bodies = [];
const replies = JSON.parse(process.argv[3]);
function sse(text) {
  const chunk = `data: ${JSON.stringify({choices: [{index: 0, delta: {content: text}, finish_reason: "stop"}]})}\n\ndata: [DONE]\n\n`;
  let sent = false;
  return { getReader: () => ({ read: async () => sent ? { done: true } : (sent = true, { value: new TextEncoder().encode(chunk), done: false }) }) };
}
const context = {
  document: { getElementById: (id) => (ids[id] = ids[id] || fake()), createElement: () => fake(),
              createTextNode: () => fake(), createDocumentFragment: () => fake() },
  localStorage: { getItem: () => null, setItem() {} },
  fetch: async (url, opts) => {
    if (url.endsWith("/models")) return { status: 200, ok: true, json: async () => ({ data: [{ id: "tiny" }] }) };
    bodies.push(JSON.parse(opts.body));
    const r = replies.shift();
    if (r.status !== 200) return { status: r.status, ok: false, json: async () => ({ error: { message: r.text } }) };
    return { status: 200, ok: true, body: sse(r.text) };
  },
  TextDecoder, TextEncoder, AbortController, console, setTimeout, requestAnimationFrame: (f) => setTimeout(f, 0),
};
vm.createContext(context);
vm.runInContext(fs.readFileSync(process.argv[2], "utf8") + "\n;globalThis.__t = { send, state };", context);
(async () => {
  for (const text of ["first", "second", "third"]) await context.__t.send(text);
  console.log(JSON.stringify({ bodies: bodies.map((b) => b.messages), history: context.__t.state.messages }));
})();
"""


@pytest.mark.skipif(NODE is None, reason="no node to run chat.js")
def test_a_refused_turn_is_dropped_from_the_history(tmp_path):
    harness = tmp_path / "harness.js"
    harness.write_text(HARNESS)
    replies = [{"status": 400, "text": "'messages': too long"}, {"status": 200, "text": "ok"},
               {"status": 200, "text": "fine"}]
    r = subprocess.run([NODE, str(harness), str(CHAT_JS), json.dumps(replies)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-800:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    user = lambda t: {"role": "user", "content": t}          # noqa: E731
    assert out["bodies"] == [[user("first")], [user("second")],
                             [user("second"), {"role": "assistant", "content": "ok"}, user("third")]]
    assert out["history"] == out["bodies"][2] + [{"role": "assistant", "content": "fine"}]
