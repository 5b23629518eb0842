// The chat page and live dashboard of llamarunner: vanilla ES2020, no libraries, no build step.
// Served under a strict CSP: no inline scripts or styles, no eval, same-origin fetches only.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };

  // --- storage ---------------------------------------------------------------------------
  const PREFIX = "llamarunner.";
  const store = {
    get(name, fallback) {
      try {
        const v = localStorage.getItem(PREFIX + name);
        return v === null ? fallback : JSON.parse(v);
      } catch (e) {
        return fallback;
      }
    },
    set(name, value) {
      try {
        localStorage.setItem(PREFIX + name, JSON.stringify(value));
        return true;
      } catch (e) {
        return false;
      }
    },
  };

  function notice(text) {
    $("notice").textContent = text || "";
    $("notice").hidden = !text;
  }

  // --- API key and requests ----------------------------------------------------------------
  let apiKey = String(store.get("key", "") || "");
  let keyWaiters = [];

  /** Opens the key dialog; resolves true once a key is saved, false when cancelled. */
  function askKey(why) {
    return new Promise((resolve) => {
      keyWaiters.push(resolve);
      const dlg = $("key-dialog");
      if (!dlg.open) {
        $("key-why").textContent = why;
        $("api-key").value = apiKey;
        dlg.showModal();
        $("api-key").focus();
      }
    });
  }

  function closeKey(saved) {
    if (saved) {
      apiKey = $("api-key").value.trim();
      store.set("key", apiKey);
    }
    const dlg = $("key-dialog");
    if (dlg.open) dlg.close();
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((w) => w(saved));
  }

  /** fetch() with the API key; on a 401 asks for a key and tries again. */
  async function api(path, options = {}) {
    for (let tries = 0; ; tries++) {
      const headers = Object.assign({}, options.headers);
      if (apiKey) headers.Authorization = "Bearer " + apiKey;
      const res = await fetch(path, Object.assign({}, options, { headers }));
      if (res.status !== 401 || tries >= 5) return res;
      const why = apiKey
        ? "The server refused this key. Enter another one."
        : "This server needs an API key. It is kept in this browser's storage.";
      if (!(await askKey(why))) return res;
    }
  }

  /** The message of an error answer: the API's {"error": {"message"}} (or a string). */
  async function errorText(res) {
    let text = "";
    try {
      text = await res.text();
    } catch (e) {
      // no body
    }
    try {
      const err = JSON.parse(text).error;
      if (typeof err === "string") return err;
      if (err && err.message) return String(err.message);
    } catch (e) {
      // not JSON
    }
    return "HTTP " + res.status + (text ? ": " + text.slice(0, 300) : "");
  }

  // --- Markdown ----------------------------------------------------------------------------
  // Every piece of text is escaped; the only markup is the fixed tags below, and links only
  // to http(s) URLs. No attribute takes text but an escaped, checked URL or a class name.
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);

  function emphasis(raw) {
    return esc(raw)
      .replace(/\*\*(?=\S)(.{1,300}?)(?<=\S)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[^\w])__(?=\S)(.{1,300}?)(?<=\S)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*])\*(?=[^\s*])(.{1,300}?)(?<=[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|[^\w])_(?=[^\s_])(.{1,300}?)(?<=[^\s_])_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)(.{1,300}?)(?<=\S)~~/g, "<del>$1</del>")
      .replace(/\n/g, "<br>");
  }

  const link = (url, text) =>
    '<a href="' + esc(url) + '" target="_blank" rel="noopener noreferrer">' + text + "</a>";

  // Code spans, [text](http(s) URL) links and bare http(s) URLs; emphasis in between.
  const INLINE =
    /(`+)([^\n]+?)\1(?!`)|\[([^\]\n]{1,300})\]\(\s*(https?:\/\/[^\s()<>"']+)\s*\)|(https?:\/\/[^\s<>()"']*[^\s<>().,;:!?'"*_])/g;

  function inline(raw) {
    let out = "";
    let last = 0;
    for (const m of raw.matchAll(INLINE)) {
      out += emphasis(raw.slice(last, m.index));
      if (m[1]) out += "<code>" + esc(m[2]) + "</code>";
      else if (m[3]) out += link(m[4], emphasis(m[3]));
      else out += link(m[5], esc(m[5]));
      last = m.index + m[0].length;
    }
    return out + emphasis(raw.slice(last));
  }

  const KEYWORDS = new Set(
    ("as async await break case catch class const continue def default del do elif else enum " +
      "except export extends false final finally fn for from func function go if impl import in " +
      "interface is lambda let loop match mod mut new nil none None not null of or package pass " +
      "pub raise return self static struct super switch this throw true True False try type " +
      "typeof use var void while with yield").split(" ")
  );
  const HASH_COMMENTS = /^(py|python|sh|bash|shell|zsh|console|rb|ruby|ya?ml|toml|r|perl|pl|ini|conf|dockerfile|make(file)?|nix|ps1|powershell|elixir|ex)$/;
  const DASH_COMMENTS = /^(sql|lua|hs|haskell)$/;
  const PLAIN = /^(|text|txt|plain|plaintext|output|log|md|markdown)$/;
  const TOKENS = (comment) =>
    new RegExp(
      "(" + comment + ")" +
        /|("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'|`(?:\\.|[^`\\])*`)/.source +
        /|(\b(?:0x[\da-fA-F]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b)|([A-Za-z_$][\w$]*)/.source,
      "g"
    );
  const HASH_TOKENS = TOKENS(/#.*/.source);
  const DASH_TOKENS = TOKENS(/--.*/.source);
  const C_TOKENS = TOKENS(/\/\/.*|\/\*[\s\S]*?(?:\*\/|$)/.source);

  /** A tiny highlighter: comments, strings, numbers and keywords, each piece escaped. */
  function highlight(code, lang) {
    if (PLAIN.test(lang)) return esc(code);
    const re = HASH_COMMENTS.test(lang) ? HASH_TOKENS : DASH_COMMENTS.test(lang) ? DASH_TOKENS : C_TOKENS;
    let out = "";
    let last = 0;
    for (const m of code.matchAll(re)) {
      out += esc(code.slice(last, m.index));
      const t = esc(m[0]);
      const cls = m[1] !== undefined ? "tc" : m[2] !== undefined ? "ts" : m[3] !== undefined ? "tn" : KEYWORDS.has(m[0]) ? "tk" : "";
      out += cls ? '<span class="' + cls + '">' + t + "</span>" : t;
      last = m.index + m[0].length;
    }
    return out + esc(code.slice(last));
  }

  function codeBlock(code, lang) {
    return (
      '<div class="code"><div class="code-head"><span>' + esc(lang || "text") +
      '</span><button type="button" class="copy">Copy</button></div><pre><code>' +
      highlight(code, lang) + "</code></pre></div>"
    );
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])( +|$)(.*)$/;
  const TABLE_RULE = /^ *\|? *:?-+:? *(\| *:?-+:? *)*\|? *$/;
  const startsBlock = (l) => FENCE.test(l) || HEADING.test(l) || RULE.test(l) || QUOTE.test(l) || ITEM.test(l);
  const cells = (row) => row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());

  /** Markdown to HTML: headings, emphasis, code (spans and fenced blocks), lists, quotes,
   * tables, rules, links and paragraphs. ``depth`` bounds the nesting of lists and quotes. */
  function markdown(src, depth = 0) {
    const lines = String(src).replace(/\r\n?/g, "\n").replace(/\t/g, "    ").split("\n");
    let html = "";
    let para = [];
    const flush = () => {
      if (para.length) html += "<p>" + inline(para.join("\n")) + "</p>";
      para = [];
    };
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        flush();
        const close = new RegExp("^ {0,3}" + (m[1][0] === "`" ? "`" : "~") + "{" + m[1].length + ",}\\s*$");
        const body = [];
        for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
        i++;
        html += codeBlock(body.join("\n"), m[2].toLowerCase());
      } else if ((m = HEADING.exec(line))) {
        flush();
        const n = m[1].length;
        html += "<h" + n + ">" + inline(m[2]) + "</h" + n + ">";
        i++;
      } else if (RULE.test(line)) {
        flush();
        html += "<hr>";
        i++;
      } else if (depth < 8 && QUOTE.test(line)) {
        flush();
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) (body.push(m[1]), i++);
        html += "<blockquote>" + markdown(body.join("\n"), depth + 1) + "</blockquote>";
      } else if (depth < 8 && (m = ITEM.exec(line)) && (m[4] || !para.length)) {
        flush();
        i = list(lines, i, depth, (h) => (html += h));
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
        flush();
        const align = cells(lines[i + 1]).map((c) => (/^:-+:$/.test(c) ? ' class="ac"' : /-:$/.test(c) ? ' class="ar"' : ""));
        const row = (r, tag) => "<tr>" + cells(r).map((c, k) => "<" + tag + (align[k] || "") + ">" + inline(c) + "</" + tag + ">").join("") + "</tr>";
        html += '<div class="table"><table><thead>' + row(line, "th") + "</thead><tbody>";
        for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) html += row(lines[i], "td");
        html += "</tbody></table></div>";
      } else if (!line.trim()) {
        flush();
        i++;
      } else {
        para.push(line);
        i++;
      }
    }
    flush();
    return html;
  }

  /** One list from lines[i]; its items' bodies are Markdown themselves. Returns the next line. */
  function list(lines, i, depth, emit) {
    const ordered = /\d/.test(ITEM.exec(lines[i])[2]);
    const items = [];
    let loose = false;
    let blank = false;
    let content = Infinity; // the column of the current item's text
    for (; i < lines.length; i++) {
      const line = lines[i];
      const indent = line.length - line.trimStart().length;
      const m = ITEM.exec(line);
      if (m && indent < content) {
        if (/\d/.test(m[2]) !== ordered) break; // another kind of list
        if (blank) loose = true;
        content = indent + m[2].length + (m[3].length > 4 || !m[3].length ? 1 : m[3].length);
        items.push({ start: parseInt(m[2], 10), body: [m[4]] });
        blank = false;
      } else if (!line.trim()) {
        items[items.length - 1].body.push("");
        blank = true;
      } else if (indent >= content) {
        if (blank) loose = true;
        items[items.length - 1].body.push(line.slice(content));
        blank = false;
      } else if (!blank && !startsBlock(line)) {
        items[items.length - 1].body.push(line.trim()); // a lazy continuation line
      } else break;
    }
    const tag = ordered ? "ol" : "ul";
    const start = ordered && items[0].start !== 1 && items[0].start >= 0 ? ' start="' + items[0].start + '"' : "";
    let html = "<" + tag + start + ">";
    for (const it of items) {
      while (it.body.length && !it.body[it.body.length - 1].trim()) it.body.pop();
      let body = markdown(it.body.join("\n"), depth + 1);
      if (!loose) body = body.replace(/^<p>([\s\S]*?)<\/p>/, "$1");
      html += "<li>" + body + "</li>";
    }
    emit(html + "</" + tag + ">");
    return i;
  }

  // --- settings ----------------------------------------------------------------------------
  const NUMBERS = [
    ["temperature", "temperature", false],
    ["top-p", "top_p", false],
    ["top-k", "top_k", true],
    ["min-p", "min_p", false],
    ["max-tokens", "max_tokens", true],
    ["seed", "seed", true],
  ];

  function loadSettings() {
    const s = store.get("settings", {}) || {};
    $("system-prompt").value = typeof s.system === "string" ? s.system : "";
    for (const [id] of NUMBERS) $(id).value = s[id] !== undefined && s[id] !== null ? String(s[id]) : "";
  }

  function saveSettings() {
    const s = { system: $("system-prompt").value };
    for (const [id] of NUMBERS) s[id] = $(id).value;
    store.set("settings", s);
  }

  /** The sampling fields of a request: only those set, as numbers. */
  function samplingBody() {
    const body = {};
    for (const [id, field, integer] of NUMBERS) {
      const raw = $(id).value.trim();
      if (!raw) continue;
      const v = Number(raw);
      if (Number.isFinite(v)) body[field] = integer ? Math.trunc(v) : v;
    }
    return body;
  }

  // --- models ------------------------------------------------------------------------------
  let models = []; // [{id, status}]: status is the router's ("loaded", ...) or null
  let model = String(store.get("model", "") || "");
  let router = false;
  let vision = null; // null: not known (a router's model that is not loaded yet)

  async function loadModels() {
    const res = await api("/v1/models");
    if (!res.ok) throw new Error(await errorText(res));
    const data = (await res.json()).data || [];
    models = data.map((m) => ({ id: String(m.id), status: m.status && m.status.value ? String(m.status.value) : null }));
    router = models.length > 1;
    if (!models.some((m) => m.id === model)) model = models.length ? models[0].id : "";
    const select = $("model");
    const ids = models.map((m) => m.id).join("\n");
    if (select.dataset.ids !== ids) {
      select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
      select.dataset.ids = ids;
    }
    models.forEach((m, k) => (select.options[k].textContent = m.id + (m.status && m.status !== "loaded" ? " (" + m.status + ")" : "")));
    select.value = model;
    $("model-picker").hidden = !router;
  }

  const loaded = () => {
    const m = models.find((x) => x.id === model);
    return !m || !m.status || m.status === "loaded";
  };
  const modelQuery = () => (router && model ? "?model=" + encodeURIComponent(model) : "");

  /** Whether the model takes images (GET /props → modalities.vision). A router answers
   * /props only for a loaded model (a GET loads none), so until then it is not known. */
  async function checkVision() {
    vision = null;
    if (loaded()) {
      const res = await api("/props" + modelQuery());
      if (res.ok) {
        const props = await res.json();
        vision = !!(props.modalities && props.modalities.vision);
      }
    }
    $("attach").hidden = !vision;
    if (!vision && attachments.length) {
      attachments = [];
      renderAttachments();
    }
  }

  // --- conversations -----------------------------------------------------------------------
  const DATA_URL = /^data:image\/[\w.+-]+;base64,[A-Za-z0-9+/=]*$/;
  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

  function loadConversations() {
    const raw = store.get("conversations", []);
    const out = [];
    for (const c of Array.isArray(raw) ? raw : []) {
      if (!c || typeof c.id !== "string" || !Array.isArray(c.messages)) continue;
      const messages = c.messages.filter((m) => m && (m.role === "user" || m.role === "assistant") && typeof m.content === "string");
      for (const m of messages) {
        if (m.state === "streaming") m.state = "stopped"; // the page was left while it streamed
        m.images = Array.isArray(m.images) ? m.images.filter((u) => typeof u === "string" && DATA_URL.test(u)) : undefined;
      }
      out.push({ id: c.id, title: String(c.title || "Chat"), updated: Number(c.updated) || 0, messages });
    }
    return out;
  }

  let convs = loadConversations();
  let currentId = store.get("current", null);
  if (!convs.some((c) => c.id === currentId)) currentId = null;
  const currentConv = () => convs.find((c) => c.id === currentId) || null;

  function save() {
    store.set("current", currentId);
    if (store.set("conversations", convs)) return;
    // Over the storage quota: keep the text, drop the attached images.
    const light = convs.map((c) => Object.assign({}, c, { messages: c.messages.map((m) => Object.assign({}, m, { images: undefined })) }));
    if (store.set("conversations", light)) notice("The browser's storage is full: attached images are not kept.");
    else notice("The browser's storage is full: this conversation is not saved.");
  }

  function renderList() {
    const ul = $("conversations");
    ul.replaceChildren();
    for (const c of [...convs].sort((a, b) => b.updated - a.updated)) {
      const li = el("li", c.id === currentId ? "current" : "");
      const open = el("button", "open", c.title);
      open.type = "button";
      open.title = c.title;
      if (c.id === currentId) open.setAttribute("aria-current", "true");
      open.addEventListener("click", () => selectConv(c.id));
      const del = el("button", "del", "×");
      del.type = "button";
      del.setAttribute("aria-label", "Delete conversation " + c.title);
      del.addEventListener("click", () => {
        if (del.dataset.armed) return deleteConv(c.id);
        del.dataset.armed = "1";
        del.textContent = "Delete";
        setTimeout(() => {
          delete del.dataset.armed;
          del.textContent = "×";
        }, 3000);
      });
      li.append(open, del);
      ul.append(li);
    }
  }

  function selectConv(id) {
    if (active) active.controller.abort();
    currentId = id;
    save();
    renderList();
    renderConversation();
    $("prompt").focus();
  }

  function deleteConv(id) {
    if (active && active.conv.id === id) active.controller.abort();
    convs = convs.filter((c) => c.id !== id);
    if (currentId === id) currentId = null;
    save();
    renderList();
    renderConversation();
  }

  // --- messages ----------------------------------------------------------------------------
  const nodes = new WeakMap(); // message → its DOM parts

  function messageNode(msg) {
    const art = el("article", "msg " + msg.role);
    art.append(el("div", "role", msg.role === "user" ? "You" : "Assistant"));
    const parts = { art };
    if (msg.images && msg.images.length) {
      const box = el("div", "images");
      for (const url of msg.images) {
        const img = el("img");
        img.src = url;
        img.alt = "attached image";
        box.append(img);
      }
      art.append(box);
    }
    if (msg.role === "assistant") {
      parts.reasoning = el("details", "reasoning");
      parts.reasoning.append(el("summary", "", "Reasoning"), (parts.thought = el("div", "md")));
      parts.content = el("div", "content md");
      parts.meta = el("div", "meta");
      art.append(parts.reasoning, parts.content, parts.meta);
    } else {
      art.append((parts.content = el("div", "content text")));
    }
    nodes.set(msg, parts);
    paint(msg);
    return art;
  }

  function paint(msg) {
    const p = nodes.get(msg);
    if (!p) return;
    if (msg.role === "user") {
      p.content.textContent = msg.content;
      return;
    }
    p.art.dataset.state = msg.state || "done";
    p.reasoning.hidden = !msg.reasoning;
    if (msg.reasoning) p.thought.innerHTML = markdown(msg.reasoning);
    p.reasoning.firstChild.textContent = msg.state === "streaming" && !msg.content ? "Reasoning…" : "Reasoning";
    p.content.innerHTML = markdown(msg.content);
    p.meta.replaceChildren();
    if (msg.error) p.meta.append(el("div", "error", msg.error));
    const info = statsText(msg);
    if (info) p.meta.append(el("span", "info", info));
  }

  const fmtMs = (ms) => (ms < 1000 ? Math.round(ms) + " ms" : (ms / 1000).toFixed(1) + " s");

  function statsText(msg) {
    const parts = [];
    if (msg.state === "streaming") parts.push("generating…");
    if (msg.state === "stopped") parts.push("stopped");
    const s = msg.stats;
    if (s) {
      if (s.tokens !== undefined) parts.push(s.tokens + " tokens");
      if (s.tps) parts.push(s.tps.toFixed(1) + " tok/s");
      if (s.prompt !== undefined) parts.push((s.cached || 0) + " of " + s.prompt + " prompt tokens cached");
      if (s.ttft !== undefined) parts.push("first token after " + fmtMs(s.ttft));
    }
    if (msg.finish === "length") parts.push("cut at the length limit");
    if (msg.model && router) parts.push(msg.model);
    return parts.join(" · ");
  }

  function renderConversation() {
    const box = $("messages");
    const conv = currentConv();
    box.replaceChildren();
    if (!conv || !conv.messages.length) box.append(el("p", "empty", "Ask something to start a conversation."));
    else for (const m of conv.messages) box.append(messageNode(m));
    box.scrollTop = box.scrollHeight;
    updateButtons();
  }

  function updateButtons() {
    const conv = currentConv();
    const streaming = !!active;
    $("send").hidden = streaming;
    $("stop").hidden = !streaming;
    $("regenerate").disabled = streaming || !conv || !conv.messages.some((m) => m.role === "user");
  }

  // --- streaming ---------------------------------------------------------------------------
  let active = null; // {controller, conv, msg}

  /** Reads a server-sent event stream, calling onData with each event's parsed JSON data;
   * true when it ended with [DONE]. */
  async function readEvents(body, onData) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let data = [];
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return false;
        buffer += decoder.decode(value, { stream: true });
        let nl;
        while ((nl = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, nl).replace(/\r$/, "");
          buffer = buffer.slice(nl + 1);
          if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          else if (!line && data.length) {
            const text = data.join("\n");
            data = [];
            if (text === "[DONE]") return true;
            onData(JSON.parse(text));
          }
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function chatMessages(conv) {
    const out = [];
    const system = $("system-prompt").value.trim();
    if (system) out.push({ role: "system", content: system });
    for (const m of conv.messages) {
      if (m.role === "user") {
        const images = (m.images || []).map((url) => ({ type: "image_url", image_url: { url } }));
        out.push({ role: "user", content: images.length ? [...images, { type: "text", text: m.content }] : m.content });
      } else if (m.content && m.state !== "error") {
        out.push({ role: "assistant", content: m.content });
      }
    }
    return out;
  }

  let painting = 0;
  let lastSave = 0;
  function schedulePaint() {
    if (painting) return;
    painting = requestAnimationFrame(() => {
      painting = 0;
      if (!active) return;
      const box = $("messages");
      const pinned = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      paint(active.msg);
      if (pinned) box.scrollTop = box.scrollHeight;
      if (performance.now() - lastSave > 1000) {
        lastSave = performance.now();
        save();
      }
    });
  }

  async function generate(conv) {
    const msg = { role: "assistant", content: "", reasoning: "", state: "streaming", model: model || undefined };
    const messages = chatMessages(conv);
    conv.messages.push(msg);
    conv.updated = Date.now();
    const controller = new AbortController();
    active = { controller, conv, msg };
    save();
    renderList();
    renderConversation();
    const body = Object.assign({ messages, stream: true, stream_options: { include_usage: true } }, samplingBody());
    if (model) body.model = model;
    const started = performance.now();
    let first = 0;
    let last = 0;
    let usage = null;
    try {
      const res = await api("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!res.ok) throw new Error(await errorText(res));
      const ended = await readEvents(res.body, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) return;
        const delta = choice.delta || {};
        const text = delta.content || "";
        const thought = delta.reasoning_content || "";
        if (text || thought) {
          last = performance.now();
          if (!first) first = last;
          msg.content += text;
          msg.reasoning += thought;
          schedulePaint();
        }
        if (choice.finish_reason) msg.finish = choice.finish_reason;
      });
      if (!ended && !msg.finish) throw new Error("The answer's stream ended early.");
      msg.state = "done";
    } catch (e) {
      if (controller.signal.aborted) msg.state = "stopped";
      else {
        msg.state = "error";
        msg.error = e && e.message ? e.message : String(e);
      }
    }
    if (usage) {
      const n = usage.completion_tokens;
      msg.stats = {
        tokens: n,
        prompt: usage.prompt_tokens,
        cached: usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : undefined,
        tps: n > 1 && last > first ? ((n - 1) * 1000) / (last - first) : undefined,
        ttft: first ? first - started : undefined,
      };
    }
    if (!msg.reasoning) delete msg.reasoning;
    active = null;
    conv.updated = Date.now();
    save();
    const box = $("messages");
    const pinned = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    paint(msg);
    if (pinned) box.scrollTop = box.scrollHeight;
    updateButtons();
    if (vision === null) loadModels().then(checkVision).catch(() => {}); // a router's model is loaded now
  }

  function send() {
    if (active) return;
    const text = $("prompt").value;
    if (!text.trim() && !attachments.length) return;
    let conv = currentConv();
    if (!conv) {
      conv = { id: newId(), title: "New chat", updated: Date.now(), messages: [] };
      convs.push(conv);
      currentId = conv.id;
    }
    if (!conv.messages.length) conv.title = text.trim().replace(/\s+/g, " ").slice(0, 60) || "Image";
    conv.messages.push({ role: "user", content: text, images: attachments.length ? attachments : undefined });
    attachments = [];
    renderAttachments();
    $("prompt").value = "";
    generate(conv);
  }

  function regenerate() {
    const conv = currentConv();
    if (active || !conv) return;
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
    if (conv.messages.length) generate(conv);
  }

  // --- attachments -------------------------------------------------------------------------
  let attachments = [];

  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren();
    attachments.forEach((url, k) => {
      const fig = el("figure");
      const img = el("img");
      img.src = url;
      img.alt = "image to send";
      const rm = el("button", "del", "×");
      rm.type = "button";
      rm.setAttribute("aria-label", "Remove image");
      rm.addEventListener("click", () => {
        attachments.splice(k, 1);
        renderAttachments();
      });
      fig.append(img, rm);
      box.append(fig);
    });
    box.hidden = !attachments.length;
  }

  function addImages(files) {
    for (const f of files) {
      if (!f.type.startsWith("image/")) continue;
      const reader = new FileReader();
      reader.onload = () => {
        if (typeof reader.result === "string" && DATA_URL.test(reader.result)) {
          attachments.push(reader.result);
          renderAttachments();
        }
      };
      reader.readAsDataURL(f);
    }
  }

  // --- dashboard ---------------------------------------------------------------------------
  let pollTimer = 0;
  let polling = false;
  let metricsOff = false;
  let previous = null; // the last sample: {t, model, gen, prompt, slots: {id: {rid, gen}}}

  /** Prometheus text format → [{name, labels, value}]. */
  function parseMetrics(text) {
    const out = [];
    for (const line of text.split("\n")) {
      if (!line || line[0] === "#") continue;
      const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(/([A-Za-z_]\w*)="((?:[^"\\]|\\.)*)"/g)) {
        labels[l[1]] = l[2].replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
      }
      const v = m[3] === "+Inf" ? Infinity : m[3] === "-Inf" ? -Infinity : Number(m[3]);
      out.push({ name: m[1], labels, value: v });
    }
    return out;
  }

  const fmtNum = (n) => (n === undefined || !Number.isFinite(n) ? "–" : Math.round(n).toLocaleString("en-US"));
  const fmtPct = (a, b) => (b > 0 ? ((100 * a) / b).toFixed(1) + " %" : "–");
  function fmtBytes(n) {
    if (n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB"];
    let k = 0;
    while (n >= 1024 && k < units.length - 1) (n /= 1024), k++;
    return (k ? n.toFixed(1) : n) + " " + units[k];
  }
  function fmtAgo(ms) {
    if (!ms) return "never";
    const s = Math.max(0, (Date.now() - ms) / 1000);
    return s < 60 ? Math.round(s) + " s ago" : s < 3600 ? Math.round(s / 60) + " min ago" : Math.round(s / 3600) + " h ago";
  }

  function card(id, label, value, sub) {
    const c = el("div", "card");
    c.id = "stat-" + id;
    c.append(el("div", "label", label), el("div", "value", value));
    if (sub) c.append(el("div", "sub", sub));
    return c;
  }

  function showMetrics(samples, now) {
    // The samples of the picked model (a router's merged metrics carry each engine's model_name).
    const mine = samples.filter((s) => !router || !s.labels.model_name || s.labels.model_name === model);
    const get = (name, where) => {
      const hits = mine.filter((s) => s.name === "llamarunner:" + name && (!where || where(s.labels)));
      return hits.length ? hits.reduce((a, s) => a + s.value, 0) : undefined;
    };
    const gen = get("generation_tokens_total");
    const prompt = get("prompt_tokens_total");
    const cached = get("prompt_tokens_cached_total");
    const rate = (v, old) => (previous && previous.model === model && v !== undefined && old !== undefined && now > previous.t ? ((v - old) * 1000) / (now - previous.t) : undefined);
    const genRate = rate(gen, previous && previous.gen);
    const promptRate = rate(prompt, previous && previous.prompt);
    const kv = get("kv_cache_usage_perc");
    const drafted = get("spec_decode_num_draft_tokens_total");
    const accepted = get("spec_decode_num_accepted_tokens_total");
    const ttftSum = get("time_to_first_token_seconds_sum");
    const ttftCount = get("time_to_first_token_seconds_count");
    const ok = get("request_success_total");
    const rejected = get("requests_rejected_total");
    const state = mine.find((s) => s.name === "llamarunner:router_model_state" && s.value === 1);
    const cards = [
      card("running", "Running", fmtNum(get("requests_running")), "of " + fmtNum(get("slots_total")) + " slots"),
      card("queue", "Waiting", fmtNum(get("requests_waiting")), "requests in the queue"),
      card("gen-rate", "Generation", genRate === undefined ? "–" : genRate.toFixed(1) + " tok/s", fmtNum(gen) + " tokens in all"),
      card("prompt-rate", "Prompt", promptRate === undefined ? "–" : promptRate.toFixed(1) + " tok/s", fmtNum(prompt) + " tokens in all"),
      card("kv", "KV cache", kv === undefined ? "–" : (kv * 100).toFixed(1) + " %", "of the context in use"),
      card("prefix", "Prefix cache hits", fmtPct(cached || 0, prompt), fmtNum(cached) + " prompt tokens reused"),
      card("prompt-cache", "Prompt cache (RAM)", fmtNum(get("prompt_cache_entries")) + " seq", fmtBytes(get("prompt_cache_bytes")) + ", " + fmtNum(get("prompt_cache_restored_tokens_total")) + " tokens restored"),
      card("draft", "Drafting acceptance", fmtPct(accepted || 0, drafted), fmtNum(accepted) + " of " + fmtNum(drafted) + " drafted tokens"),
      card("ttft", "Time to first token", ttftCount ? fmtMs((ttftSum * 1000) / ttftCount) : "–", "mean of " + fmtNum(ttftCount) + " requests"),
      card("requests", "Requests", fmtNum(ok), fmtNum(rejected) + " refused or cancelled"),
    ];
    if (state) cards.push(card("model-state", "Model", state.labels.state, model));
    $("stats").replaceChildren(...cards);
    return { gen, prompt };
  }

  function showSlots(slots, now) {
    const rows = slots.map((s) => {
      const tr = el("tr", s.busy ? "busy" : "");
      tr.dataset.busy = String(!!s.busy);
      tr.dataset.phase = s.phase || "";
      if (s.request_id) tr.title = "request " + s.request_id;
      const old = previous && previous.model === model && previous.slots[s.id];
      let gen = fmtNum(s.generated_tokens);
      if (s.busy && old && old.rid === s.request_id && now > previous.t && s.generated_tokens >= old.gen) {
        gen += " (" + (((s.generated_tokens - old.gen) * 1000) / (now - previous.t)).toFixed(1) + "/s)";
      }
      const promptText = s.phase === "prefill" ? fmtNum(s.prompt_processed_tokens) + " / " + fmtNum(s.prompt_tokens) : fmtNum(s.prompt_tokens);
      const state = s.busy ? (s.paused ? "paused" : "busy") : "idle";
      const cellsText = [s.id, state, s.phase || "–", promptText, fmtNum(s.prompt_cached_tokens), gen, fmtNum(s.cached_tokens), fmtAgo(s.last_used_ms)];
      cellsText.forEach((t, k) => {
        const td = el("td", k === 1 ? "state " + state : "", String(t));
        tr.append(td);
      });
      return tr;
    });
    $("slots").replaceChildren(...rows);
  }

  function slotsMessage(text) {
    const tr = el("tr");
    const td = el("td", "hint", text);
    td.colSpan = 8;
    tr.append(td);
    $("slots").replaceChildren(tr);
  }

  async function refreshDashboard() {
    if (router || !models.length) await loadModels();
    const now = Date.now();
    const isLoaded = loaded();
    const [slotsRes, metricsRes] = await Promise.all([isLoaded ? api("/slots" + modelQuery()) : null, metricsOff ? null : api("/metrics")]);
    let sample = { t: now, model, slots: {} };
    if (metricsRes) {
      if (metricsRes.status === 404) {
        metricsOff = true;
        $("stats").replaceChildren();
      } else if (metricsRes.ok) {
        Object.assign(sample, showMetrics(parseMetrics(await metricsRes.text()), now));
      } else {
        $("stats").replaceChildren(el("p", "error", "GET /metrics: " + (await errorText(metricsRes))));
      }
    }
    $("metrics-status").hidden = !metricsOff;
    $("metrics-status").textContent = "Metrics are off on this server (--no-metrics): only the slots are shown.";
    if (!slotsRes) {
      const m = models.find((x) => x.id === model);
      slotsMessage("Model " + model + " is " + (m ? m.status : "not loaded") + ": its slots appear once it is loaded (on its first request).");
    } else if (slotsRes.ok) {
      const table = await slotsRes.json();
      const slots = Array.isArray(table) ? table : [];
      showSlots(slots, now);
      for (const s of slots) sample.slots[s.id] = { rid: s.request_id, gen: s.generated_tokens };
      const busy = slots.filter((s) => s.busy).length;
      $("dash-status").textContent = (model ? model + " · " : "") + busy + " of " + slots.length + " slots busy · updated " + new Date(now).toLocaleTimeString();
    } else {
      slotsMessage("GET /slots: " + (await errorText(slotsRes)));
    }
    if (!slotsRes || !slotsRes.ok) $("dash-status").textContent = (model ? model + " · " : "") + "updated " + new Date(now).toLocaleTimeString();
    previous = sample;
  }

  const dashboardShown = () => !$("dashboard-view").hidden && !document.hidden;

  async function poll() {
    pollTimer = 0;
    if (polling || !dashboardShown()) return;
    polling = true;
    try {
      await refreshDashboard();
    } catch (e) {
      $("dash-status").textContent = "Cannot read the server: " + (e && e.message ? e.message : e);
    }
    polling = false;
    if (dashboardShown() && !pollTimer) pollTimer = setTimeout(poll, 1000);
  }

  // --- tabs --------------------------------------------------------------------------------
  function showTab(name, push) {
    const dash = name === "dashboard";
    $("chat-view").hidden = dash;
    $("dashboard-view").hidden = !dash;
    $("tab-chat").setAttribute("aria-selected", String(!dash));
    $("tab-dashboard").setAttribute("aria-selected", String(dash));
    document.title = dash ? "Dashboard · llamarunner" : "llamarunner";
    if (push && location.pathname !== (dash ? "/dashboard" : "/")) window.history.pushState(null, "", dash ? "/dashboard" : "/");
    clearTimeout(pollTimer);
    pollTimer = 0;
    if (dash) poll();
  }

  // --- wiring ------------------------------------------------------------------------------
  function init() {
    loadSettings();
    renderList();
    renderConversation();
    $("tab-chat").addEventListener("click", () => showTab("chat", true));
    $("tab-dashboard").addEventListener("click", () => showTab("dashboard", true));
    window.addEventListener("popstate", () => showTab(location.pathname === "/dashboard" ? "dashboard" : "chat", false));
    document.addEventListener("visibilitychange", () => dashboardShown() && !pollTimer && poll());

    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    $("prompt").addEventListener("paste", (e) => {
      const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
      if (vision && files.length) {
        e.preventDefault();
        addImages(files);
      }
    });
    $("stop").addEventListener("click", () => active && active.controller.abort());
    $("regenerate").addEventListener("click", regenerate);
    $("new-chat").addEventListener("click", () => selectConv(null));
    $("file").addEventListener("change", () => {
      addImages([...$("file").files]);
      $("file").value = "";
    });
    $("messages").addEventListener("click", (e) => {
      const button = e.target.closest(".copy");
      if (!button) return;
      const code = button.closest(".code").querySelector("code").textContent;
      const done = () => {
        button.textContent = "Copied";
        setTimeout(() => (button.textContent = "Copy"), 1500);
      };
      if (navigator.clipboard) navigator.clipboard.writeText(code).then(done, () => {});
    });

    $("settings-toggle").addEventListener("click", () => {
      const open = $("settings").hidden;
      $("settings").hidden = !open;
      $("settings-toggle").setAttribute("aria-expanded", String(open));
    });
    $("settings").addEventListener("input", saveSettings);
    $("settings-reset").addEventListener("click", () => {
      store.set("settings", {});
      loadSettings();
    });
    $("key-button").addEventListener("click", () => askKey("The API key this page sends (empty: none). It is kept in this browser's storage.").then((saved) => saved && start()));
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      closeKey(true);
    });
    $("api-key-cancel").addEventListener("click", () => closeKey(false));
    $("key-dialog").addEventListener("close", () => keyWaiters.length && !$("key-dialog").open && closeKey(false));
    $("model").addEventListener("change", () => {
      model = $("model").value;
      store.set("model", model);
      previous = null;
      checkVision().catch(() => {});
      if (dashboardShown()) {
        clearTimeout(pollTimer);
        poll();
      }
    });
    window.addEventListener("storage", (e) => {
      if (e.key === PREFIX + "conversations" && !active) {
        convs = loadConversations();
        if (!currentConv()) currentId = null;
        renderList();
        renderConversation();
      }
    });

    showTab(location.pathname === "/dashboard" ? "dashboard" : "chat", false);
    start();
  }

  function start() {
    loadModels()
      .then(() => {
        notice("");
        return checkVision();
      })
      .catch((e) => notice("Cannot read the server's models: " + (e && e.message ? e.message : e)));
  }

  init();
})();
