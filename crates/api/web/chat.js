// Bulkhead's chat page. It streams from POST /v1/chat/completions (server-sent events) and
// renders the answer's Markdown by building DOM nodes whose text is set with textContent or
// createTextNode only, so model output can never become markup or script. The page runs
// under a Content-Security-Policy with no inline script or style.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "bulkhead.apiKey"; // sessionStorage only: gone when the tab closes
  const keyRequired = document.documentElement.dataset.auth === "required";

  /** The conversation so far: {role, content} as the API takes it. */
  let history = [];
  /** The running generation's AbortController, or null. */
  let controller = null;

  function el(tag, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  }

  // ---- Markdown, as DOM nodes -------------------------------------------------------------

  // `code`, **bold**, *italic* (not `* ` as in a product) and [text](url). No `__bold__`:
  // identifiers like __init__ are common in model output.
  const INLINE = /`([^`\n]+)`|\*\*([^*\n]+)\*\*|\*([^*\s][^*\n]*)\*|\[([^\]\n]+)\]\(([^()\s]+)\)/g;

  /** Appends `text` to `parent`, with `code`, **bold**, *italic* and [links](url). */
  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
      if (m[1] !== undefined) {
        const c = el("code");
        c.textContent = m[1];
        parent.append(c);
      } else if (m[2] !== undefined) {
        const b = el("strong");
        inline(m[2], b);
        parent.append(b);
      } else if (m[3] !== undefined) {
        const i = el("em");
        inline(m[3], i);
        parent.append(i);
      } else {
        link(m[4], m[5], m[0], parent);
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  /** A link only to http(s); any other scheme (javascript:, data:, …) stays as its text. */
  function link(label, href, raw, parent) {
    let url = null;
    try {
      url = new URL(href);
    } catch {
      url = null; // relative or malformed: not a link
    }
    if (url && (url.protocol === "http:" || url.protocol === "https:")) {
      const a = el("a");
      a.href = url.href;
      a.rel = "noopener noreferrer nofollow";
      a.target = "_blank";
      a.textContent = label;
      a.title = url.href;
      parent.append(a);
    } else {
      parent.append(document.createTextNode(raw));
    }
  }

  const FENCE = /^\s*(```+|~~~+)\s*([\w+.#-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;
  const QUOTE = /^\s*>\s?(.*)$/;

  /** Replaces `root`'s children with `text` rendered as Markdown (a safe subset). */
  function renderMarkdown(text, root) {
    const out = document.createDocumentFragment();
    const lines = text.split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        // Everything to the closing fence (or the end, while it streams) is code, verbatim.
        const code = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
        i++;
        const pre = el("pre");
        const c = el("code");
        if (fence[2]) pre.dataset.lang = fence[2];
        c.textContent = code.join("\n");
        pre.append(c);
        out.append(pre);
        continue;
      }
      if (line.trim() === "") {
        i++;
        continue;
      }
      const h = line.match(HEADING);
      if (h) {
        const e = el("h" + Math.min(h[1].length + 2, 6));
        inline(h[2], e);
        out.append(e);
        i++;
        continue;
      }
      if (ITEM.test(line)) {
        const ordered = /^\s*\d/.test(line);
        const list = el(ordered ? "ol" : "ul");
        while (i < lines.length && ITEM.test(lines[i])) {
          const li = el("li");
          inline(lines[i].match(ITEM)[2], li);
          list.append(li);
          i++;
        }
        out.append(list);
        continue;
      }
      if (QUOTE.test(line)) {
        const q = el("blockquote");
        const body = [];
        while (i < lines.length && QUOTE.test(lines[i])) body.push(lines[i++].match(QUOTE)[1]);
        inline(body.join("\n"), q);
        out.append(q);
        continue;
      }
      // A paragraph: up to a blank line or the start of another block. Line breaks stay
      // (white-space: pre-wrap in the stylesheet).
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) && !ITEM.test(lines[i])) {
        para.push(lines[i++]);
      }
      const p = el("p");
      inline(para.join("\n"), p);
      out.append(p);
    }
    root.replaceChildren(out);
  }

  // ---- The page ------------------------------------------------------------------------------

  function apiKey() {
    return sessionStorage.getItem(KEY_STORE) || "";
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const k = apiKey();
    if (k) h.Authorization = "Bearer " + k;
    return h;
  }

  function showError(text) {
    $("error").textContent = text || "";
    $("error").hidden = !text;
  }

  function askForKey(refused) {
    $("key-box").hidden = false;
    if (refused) {
      showError(
        apiKey()
          ? "401 Unauthorized: the server refused this API key. Check it and try again."
          : "401 Unauthorized: this server needs an API key. Enter your tenant's key on the left.",
      );
      $("api-key").focus();
    }
  }

  /** The error message of a failed response: the OpenAI error body's, else the status. */
  async function failure(r) {
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) return `${r.status}: ${body.error.message}`;
    } catch {
      // not JSON
    }
    return `${r.status} ${r.statusText}`;
  }

  async function loadModels() {
    let r;
    try {
      r = await fetch("/v1/models", { headers: headers() });
    } catch (e) {
      showError("Cannot reach the server: " + e.message);
      return;
    }
    if (r.status === 401) {
      askForKey(true);
      return;
    }
    if (!r.ok) {
      showError("Could not list the models: " + (await failure(r)));
      return;
    }
    const body = await r.json();
    const select = $("model");
    const was = select.value;
    select.replaceChildren();
    for (const m of body.data || []) {
      const o = el("option");
      o.value = m.id;
      o.textContent = m.id;
      select.append(o);
    }
    if (was) select.value = was;
    showError("");
  }

  function addMessage(role, text) {
    const m = el("div", "msg " + role);
    const who = el("div", "who");
    who.textContent = role === "user" ? "You" : "Assistant";
    const body = el("div", "body");
    if (role === "user") body.textContent = text;
    else renderMarkdown(text, body);
    m.append(who, body);
    $("messages").append(m);
    m.scrollIntoView({ block: "end" });
    return { message: m, body };
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.classList.toggle("busy", busy);
  }

  function number(id, fallback) {
    const v = Number($(id).value);
    return Number.isFinite(v) ? v : fallback;
  }

  /** Reads the event stream of `r`, calling `onChunk` with each parsed `data:` object. */
  async function readEvents(r, onChunk) {
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data && data !== "[DONE]") onChunk(JSON.parse(data));
        }
      }
    }
  }

  async function send(text) {
    showError("");
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const out = addMessage("assistant", "");
    out.message.classList.add("streaming");
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history);
    const body = {
      model: $("model").value || undefined,
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: number("temperature", 0.7),
      max_tokens: Math.max(1, Math.floor(number("max-tokens", 256))),
    };
    controller = new AbortController();
    setBusy(true);
    const start = performance.now();
    let first = 0;
    let last = 0;
    let chunks = 0;
    let usage = null;
    let finish = null;
    let answer = "";
    let pending = false;
    const stats = $("stats");
    const showStats = () => {
      const parts = [];
      if (first) parts.push(`TTFT ${((first - start) / 1000).toFixed(2)} s`);
      const n = usage ? usage.completion_tokens : chunks;
      if (n > 1 && last > first) parts.push(`${((n - 1) / ((last - first) / 1000)).toFixed(1)} tokens/s`);
      if (n) parts.push(`${n} tokens`);
      if (finish) parts.push(finish);
      stats.textContent = parts.join(" · ");
    };
    // Re-render at most once a frame, however fast tokens arrive.
    const render = () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        renderMarkdown(answer, out.body);
        showStats();
        out.message.scrollIntoView({ block: "end" });
      });
    };
    stats.textContent = "waiting for the first token…";
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers(),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (r.status === 401) {
        askForKey(true);
        throw new Error("refused");
      }
      if (!r.ok) {
        showError(await failure(r));
        throw new Error("failed");
      }
      await readEvents(r, (chunk) => {
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          const d = c.delta && c.delta.content;
          if (d) {
            const now = performance.now();
            if (!first) first = now;
            last = now;
            chunks++;
            answer += d;
            render();
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
      });
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else if (e.message !== "refused" && e.message !== "failed") showError("The generation failed: " + e.message);
    } finally {
      controller = null;
      setBusy(false);
      out.message.classList.remove("streaming");
      renderMarkdown(answer, out.body);
      showStats();
      if (answer) history.push({ role: "assistant", content: answer });
      else {
        // Nothing came back: take the question out, so a retry does not send it twice.
        history.pop();
        out.message.remove();
      }
      out.message.dataset.done = finish || "error";
    }
  }

  function init() {
    if (keyRequired) askForKey(false);
    $("api-key").value = apiKey();
    $("api-key").addEventListener("change", () => {
      const k = $("api-key").value.trim();
      if (k) sessionStorage.setItem(KEY_STORE, k);
      else sessionStorage.removeItem(KEY_STORE);
      loadModels();
    });
    $("ask").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("ask").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => {
      if (controller) controller.abort();
    });
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      history = [];
      $("messages").replaceChildren();
      $("stats").textContent = "";
      showError("");
    });
    loadModels();
  }

  init();
})();
