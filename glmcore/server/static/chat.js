// glmcore's chat page: talks to this server's own /v1/chat/completions (streamed), nothing else.
// Model text is untrusted: every piece of it reaches the page through textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "api_key"];
const state = { messages: [], model: null, controller: null };

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function status(text) { $("status").textContent = text; }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// ---------------------------------------------------------------------------- markdown, safely

// Inline spans: `code`, **bold**, *emphasis*; everything else is text.
function inline(parent, text) {
  const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\s][^*\n]*\*)/g;
  let last = 0, m;
  while ((m = re.exec(text)) !== null) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    const t = m[0];
    if (t[0] === "`") parent.appendChild(el("code", null, t.slice(1, -1)));
    else if (t.startsWith("**")) parent.appendChild(el("strong", null, t.slice(2, -2)));
    else parent.appendChild(el("em", null, t.slice(1, -1)));
    last = m.index + t.length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

function textBlock(parent, block) {
  const lines = block.split("\n");
  let list = null;
  let para = null;
  for (const line of lines) {
    const h = /^(#{1,3})\s+(.*)$/.exec(line);
    const li = /^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/.exec(line);
    if (h) {
      list = para = null;
      const node = el("h" + h[1].length);
      inline(node, h[2]);
      parent.appendChild(node);
    } else if (li) {
      para = null;
      const kind = li[1] ? "ol" : "ul";
      if (!list || list.tagName.toLowerCase() !== kind) { list = el(kind); parent.appendChild(list); }
      const item = el("li");
      inline(item, li[2]);
      list.appendChild(item);
    } else if (line.trim() === "") {
      list = para = null;
    } else {
      list = null;
      if (para) para.appendChild(el("br")); else { para = el("p"); parent.appendChild(para); }
      inline(para, line);
    }
  }
}

// Fenced code blocks (``` ... ```, an unclosed one runs to the end while it streams), the rest as text blocks.
function renderMarkdown(parent, text) {
  parent.replaceChildren();
  const re = /```([^\n`]*)\n([\s\S]*?)(?:```|$)/g;
  let last = 0, m;
  while ((m = re.exec(text)) !== null) {
    if (m.index > last) textBlock(parent, text.slice(last, m.index));
    const pre = el("pre");
    const code = el("code", null, m[2].replace(/\n$/, ""));
    if (m[1].trim()) code.dataset.lang = m[1].trim();
    pre.appendChild(code);
    parent.appendChild(pre);
    last = m.index + m[0].length;
    if (m[0].length === 0) break;
  }
  if (last < text.length) textBlock(parent, text.slice(last));
}

// ---------------------------------------------------------------------------- the conversation

function addMessage(role, text) {
  const box = el("div", "msg " + role);
  box.appendChild(el("div", "who", role === "user" ? "You" : role === "assistant" ? "Assistant" : "Error"));
  const content = el("div", "content");
  box.appendChild(content);
  if (text !== undefined) renderMarkdown(content, text);
  $("log").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

class Reply {
  constructor() {
    this.box = addMessage("assistant");
    this.content = this.box.querySelector(".content");
    this.text = "";
    this.thinking = "";
    this.calls = [];
    this.reasoning = null;
    this.pending = false;
  }
  addText(t) { this.text += t; this.schedule(); }
  addReasoning(t) {
    if (!this.reasoning) {
      this.reasoning = el("details", "reasoning");
      this.reasoning.open = true;
      this.reasoning.appendChild(el("summary", null, "Thinking"));
      this.reasoning.appendChild(el("div", "text"));
      this.box.insertBefore(this.reasoning, this.content);
    }
    this.thinking += t;
    this.reasoning.querySelector(".text").textContent = this.thinking;
  }
  addToolCall(d) {
    const i = d.index || 0;
    if (!this.calls[i]) {
      const node = el("div", "tool-call");
      node.appendChild(el("span", null, "Tool call: "));
      node.appendChild(el("span", "name"));
      node.appendChild(el("pre", "args"));
      this.box.appendChild(node);
      this.calls[i] = { id: "", name: "", arguments: "", node };
    }
    const c = this.calls[i];
    if (d.id) c.id = d.id;
    if (d.function && d.function.name) c.name = d.function.name;
    if (d.function && d.function.arguments) c.arguments += d.function.arguments;
    c.node.querySelector(".name").textContent = c.name;
    c.node.querySelector(".args").textContent = c.arguments;
  }
  note(t) { this.box.appendChild(el("div", "note", t)); }
  schedule() {          // one markdown render per frame, however many deltas arrive
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      renderMarkdown(this.content, this.text);
      $("log").scrollTop = $("log").scrollHeight;
    });
  }
  message() {
    const m = { role: "assistant", content: this.text };
    const calls = this.calls.filter(Boolean);
    if (calls.length) {
      m.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
    }
    return m;
  }
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("input").disabled = false;
}

function number(id) {
  const v = parseFloat($(id).value);
  return Number.isFinite(v) ? v : undefined;
}

async function send(text) {
  const history = [];
  const system = $("system").value.trim();
  if (system) history.push({ role: "system", content: system });
  const turn = { role: "user", content: text };
  state.messages.push(turn);
  const asked = addMessage("user", text);
  let failed = false;
  const body = {
    model: state.model || "default", messages: history.concat(state.messages), stream: true,
    temperature: number("temperature"), top_p: number("top_p"), max_tokens: Math.round(number("max_tokens")) || undefined,
  };
  const reply = new Reply();
  const controller = new AbortController();
  state.controller = controller;
  busy(true);
  status("generating…");
  let finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || ("HTTP " + r.status));
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) continue;
          const d = choice.delta || {};
          if (d.reasoning_content) reply.addReasoning(d.reasoning_content);
          if (d.content) reply.addText(d.content);
          for (const call of d.tool_calls || []) reply.addToolCall(call);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    status(finish === "length" ? "stopped at max tokens" : "");
    if (finish === "length") reply.note("(the reply reached max tokens)");
  } catch (e) {
    if (e.name === "AbortError") {
      reply.note("(stopped)");
      status("stopped");
    } else {
      failed = true;
      reply.box.classList.add("error");
      reply.note(String(e.message || e));
      status("error: " + (e.message || e));
      if (/API key/i.test(String(e.message))) openSettings(true);
    }
  } finally {
    state.controller = null;
    busy(false);
    renderMarkdown(reply.content, reply.text);
    if (failed) {
      // a failed turn leaves the conversation as it was: neither the message nor the error is sent again
      const i = state.messages.lastIndexOf(turn);
      if (i >= 0) state.messages.splice(i, 1);
      asked.classList.add("failed");
      asked.title = "not part of the conversation: the server refused it";
    } else {
      state.messages.push(reply.message());
    }
    $("input").focus();
  }
}

function openSettings(open) {
  $("settings").hidden = !open;
  $("toggle-settings").setAttribute("aria-expanded", String(open));
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) { status("this server needs an API key: enter it in Settings"); openSettings(true); return; }
    const j = await r.json();
    state.model = j.data && j.data[0] && j.data[0].id;
    $("model").textContent = state.model || "";
  } catch (e) {
    status("cannot reach the server: " + e.message);
  }
}

function init() {
  for (const id of SETTINGS) {          // settings survive a reload (the key only in this browser's storage)
    const saved = localStorage.getItem("glmcore." + id);
    if (saved !== null) $(id).value = saved;
    $(id).addEventListener("change", () => {
      localStorage.setItem("glmcore." + id, $(id).value);
      if (id === "api_key") loadModel();
    });
  }
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("new").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    $("log").replaceChildren();
    status("");
    $("input").focus();
  });
  $("toggle-settings").addEventListener("click", () => openSettings($("settings").hidden));
  loadModel();
}

init();
