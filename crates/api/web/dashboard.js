// Bulkhead's live isolation dashboard: polls GET /metrics (Prometheus text) every second and
// shows the evidence that the isolation checks run. With the operator's key (entered here,
// kept in sessionStorage) it also reads /metrics/tenants, where the prefix cache's activity
// is served. It reads nothing else, so it can show no prompt or completion. Every number is
// set with textContent.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;
  /** Rates over about this long. */
  const RATE_WINDOW_MS = 10_000;
  /** Latency percentiles over about this long (else since the server started). */
  const LATENCY_WINDOW_MS = 60_000;
  const ADMIN_KEY_STORE = "bulkhead.adminKey"; // sessionStorage only: gone when the tab closes
  /** Whether the last poll read the operator's page (the cache series are there). */
  let operator = false;

  /** What each isolation check (the `check` label) proves; docs/OPERATIONS.md has more. */
  const CHECKS = [
    ["chunk_verified", "every KV chunk received: page, generation, order, range, sender"],
    ["checksum", "KV chunk checksums compared on arrival"],
    ["coverage", "a transfer's claim: every prompt slot written, manifest, watermarks"],
    ["lease", "every pool read and write: page state, generation and owner"],
    ["generation", "leases re-checked live before each forward step"],
    ["canary", "freed slots checked for the poison sentinel when first read"],
    ["audit", "slot reads checked against the auditor's shadow tags (--audit-kv)"],
    ["tenant_fence", "shared prefix-cache pages: the reader's tenant fence matches the page's"],
  ];

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- Prometheus text ---------------------------------------------------------------------

  /** Parses the text format into [{name, labels, value}]. */
  function parse(text) {
    const samples = [];
    for (const raw of text.split("\n")) {
      const line = raw.trim();
      if (!line || line.startsWith("#")) continue;
      let i = 0;
      while (i < line.length && line[i] !== "{" && line[i] !== " ") i++;
      const name = line.slice(0, i);
      const labels = {};
      if (line[i] === "{") {
        i++;
        while (i < line.length && line[i] !== "}") {
          const eq = line.indexOf('="', i);
          if (eq < 0) break;
          const key = line.slice(i, eq).replace(/^,/, "").trim();
          let j = eq + 2;
          let value = "";
          while (j < line.length && line[j] !== '"') {
            if (line[j] === "\\" && j + 1 < line.length) {
              j++;
              value += line[j] === "n" ? "\n" : line[j];
            } else value += line[j];
            j++;
          }
          labels[key] = value;
          i = j + 1;
          if (line[i] === ",") i++;
        }
        i++;
      }
      const value = Number(line.slice(i).trim().split(/\s+/)[0]);
      if (name) samples.push({ name, labels, value });
    }
    return samples;
  }

  function matches(s, name, want) {
    if (s.name !== name) return false;
    for (const k in want) if (s.labels[k] !== want[k]) return false;
    return true;
  }

  /** The sum of every sample of `name` whose labels include `want`. */
  function sum(samples, name, want = {}) {
    let t = 0;
    for (const s of samples) if (matches(s, name, want)) t += s.value;
    return t;
  }

  /** A histogram's cumulative buckets, summed over its series: [[le, count]] by le. */
  function buckets(samples, name) {
    const by = new Map();
    for (const s of samples) {
      if (s.name !== name + "_bucket") continue;
      const le = s.labels.le === "+Inf" ? Infinity : Number(s.labels.le);
      by.set(le, (by.get(le) || 0) + s.value);
    }
    return [...by.entries()].sort((a, b) => a[0] - b[0]);
  }

  /** `now`'s buckets minus `then`'s (observations in between). */
  function minus(now, then) {
    const old = new Map(then);
    return now.map(([le, c]) => [le, c - (old.get(le) || 0)]);
  }

  /** The q-quantile of cumulative buckets, interpolated within a bucket as Prometheus does. */
  function quantile(q, bs) {
    if (!bs.length) return NaN;
    const total = bs[bs.length - 1][1];
    if (total <= 0) return NaN;
    const rank = q * total;
    let prevLe = 0;
    let prevCount = 0;
    for (const [le, count] of bs) {
      if (count >= rank) {
        if (le === Infinity) return prevLe;
        if (count === prevCount) return le;
        return prevLe + ((le - prevLe) * (rank - prevCount)) / (count - prevCount);
      }
      prevLe = le;
      prevCount = count;
    }
    return prevLe;
  }

  // ---- Formatting --------------------------------------------------------------------------

  function count(n) {
    if (!Number.isFinite(n)) return "–";
    if (Math.abs(n) >= 1e9) return (n / 1e9).toFixed(2) + " G";
    if (Math.abs(n) >= 1e6) return (n / 1e6).toFixed(2) + " M";
    if (Math.abs(n) >= 1e4) return (n / 1e3).toFixed(1) + " k";
    return String(Math.round(n));
  }

  function seconds(s) {
    if (!Number.isFinite(s)) return "–";
    if (s < 1) return Math.round(s * 1000) + " ms";
    return s.toFixed(2) + " s";
  }

  function bytes(n) {
    if (n >= 1 << 30) return (n / (1 << 30)).toFixed(2) + " GiB";
    if (n >= 1 << 20) return (n / (1 << 20)).toFixed(1) + " MiB";
    if (n >= 1 << 10) return (n / (1 << 10)).toFixed(1) + " KiB";
    return n + " B";
  }

  function set(id, text) {
    const e = $(id);
    if (e.textContent !== text) e.textContent = text;
  }

  // ---- State and rendering -----------------------------------------------------------------

  /** Recent scrapes, oldest first: {t, samples}. */
  const history = [];

  /** The oldest kept scrape no older than `ms` before the newest (or the oldest at all). */
  function since(ms) {
    const now = history[history.length - 1].t;
    return history.find((h) => now - h.t <= ms) || history[0];
  }

  function rate(name, want = {}) {
    const newest = history[history.length - 1];
    const old = since(RATE_WINDOW_MS);
    const dt = (newest.t - old.t) / 1000;
    if (dt <= 0) return NaN;
    return Math.max(0, sum(newest.samples, name, want) - sum(old.samples, name, want)) / dt;
  }

  /** p50 · p90 · p99 of a histogram over the last minute, else since start; and which. */
  function percentiles(name) {
    const newest = history[history.length - 1];
    const all = buckets(newest.samples, name);
    const recent = minus(all, buckets(since(LATENCY_WINDOW_MS).samples, name));
    const useRecent = recent.length && recent[recent.length - 1][1] > 0;
    const bs = useRecent ? recent : all;
    const n = bs.length ? bs[bs.length - 1][1] : 0;
    const text = [0.5, 0.9, 0.99].map((q) => seconds(quantile(q, bs))).join(" · ");
    const window = n === 0 ? "no requests yet" : `${count(n)} ${useRecent ? "in the last minute" : "since start"}`;
    return [text, window];
  }

  /** Workers that report a KV pool, in label order. */
  function workers(samples) {
    const seen = new Map();
    for (const s of samples) if (s.name === "bulkhead:kv_pool_pages" && s.labels.worker) seen.set(s.labels.worker, s.labels.role || "");
    return [...seen.entries()].sort((a, b) => a[0].localeCompare(b[0], undefined, { numeric: true }));
  }

  function renderPools(samples) {
    const root = $("pools");
    const rows = [];
    for (const [worker, role] of workers(samples)) {
      const w = { worker };
      const pool = sum(samples, "bulkhead:kv_pool_pages", w);
      const leased = sum(samples, "bulkhead:kv_leased_pages", w);
      const quarantined = sum(samples, "bulkhead:quarantined_pages", w);
      const cached = sum(samples, "bulkhead:kv_cached_pages", w);
      const free = sum(samples, "bulkhead:kv_free_pages", w);
      const row = el("div", "pool");
      row.dataset.worker = worker;
      row.append(el("span", "name", `${worker}`), el("span", "role", role));
      const bar = el("div", "stack");
      for (const [cls, n] of [
        ["leased", leased],
        ["quarantined", quarantined],
        ["cached", cached],
      ]) {
        const seg = el("span", "seg " + cls);
        // CSSOM, not a style attribute: allowed under style-src 'self'.
        seg.style.width = pool > 0 ? `${(100 * n) / pool}%` : "0%";
        bar.append(seg);
      }
      row.append(bar);
      row.append(
        el(
          "span",
          "nums",
          operator
            ? `${count(leased)} leased · ${count(quarantined)} quarantined · ${count(cached)} cached · ${count(free)} free of ${count(pool)}`
            : `${count(leased)} leased · ${count(quarantined)} quarantined of ${count(pool)} · cached and free: operator's key`,
        ),
      );
      rows.push(row);
    }
    if (!rows.length) rows.push(el("p", "hint", "No worker has registered yet."));
    root.replaceChildren(...rows);
  }

  function cell(text, cls) {
    return el("td", cls, text);
  }

  function renderChecks(samples) {
    const rows = CHECKS.map(([check, what]) => {
      const ran = sum(samples, "bulkhead:isolation_checks_total", { check });
      const failed = sum(samples, "bulkhead:isolation_failures_total", { check });
      const r = rate("bulkhead:isolation_checks_total", { check });
      const tr = el("tr");
      tr.dataset.check = check;
      const hidden = check === "tenant_fence" && !operator;
      const ranCell = cell(hidden ? "operator's key" : count(ran), "num");
      if (r > 0) ranCell.append(el("span", "rate", ` +${count(r)}/s`));
      tr.append(cell(check, "mono"), cell(what, "what"), ranCell, cell(count(failed), "num " + (failed > 0 ? "bad" : "ok")));
      return tr;
    });
    $("checks").replaceChildren(...rows);
  }

  function renderEvidence(samples) {
    const coverage = sum(samples, "bulkhead:isolation_checks_total", { check: "coverage" });
    const coverageFailed = sum(samples, "bulkhead:isolation_failures_total", { check: "coverage" });
    const chunksRefused = sum(samples, "bulkhead:isolation_failures_total", { check: "chunk_verified" });
    const apiRefused = sum(samples, "bulkhead:http_responses_total", { code: "401" });
    const items = [
      ["transfers-verified", "KV transfers verified (coverage claims accepted)", count(coverage - coverageFailed), false],
      ["transfers-refused", "KV transfers refused (claims or chunks refused)", count(coverageFailed + chunksRefused), coverageFailed + chunksRefused > 0],
      ["transfer-failures", "requests failed by a refused transfer", count(sum(samples, "bulkhead:request_failure_total", { reason: "transfer_refused" })), false],
      ["kv-bytes", "KV bytes received by decode workers", bytes(sum(samples, "bulkhead:kv_transfer_bytes_total", { role: "decode" })), false],
      ["transfer-timeouts", "KV transfers that stalled", count(sum(samples, "bulkhead:kv_transfer_timeouts_total")), false],
      ["late-chunks", "late chunks dropped unread", count(sum(samples, "bulkhead:late_chunks_total")), false],
      ["quarantined-total", "KV pages put in quarantine (writer not yet fenced)", count(sum(samples, "bulkhead:quarantined_pages_total")), false],
      ["fenced", "quarantined pages released after their writer was fenced", count(sum(samples, "bulkhead:fenced_releases_total")), false],
      ["canaries", "canary slots checked · poisoned reads", `${count(sum(samples, "bulkhead:isolation_checks_total", { check: "canary" }))} · ${count(sum(samples, "bulkhead:isolation_failures_total", { check: "canary" }))}`, sum(samples, "bulkhead:isolation_failures_total", { check: "canary" }) > 0],
      // How often the fence ran counts shared pages: the operator's; its failures are public.
      ["tenant-fence", "tenant-fence checks run · failed", `${operator ? count(sum(samples, "bulkhead:isolation_checks_total", { check: "tenant_fence" })) : "operator's key"} · ${count(sum(samples, "bulkhead:isolation_failures_total", { check: "tenant_fence" }))}`, sum(samples, "bulkhead:isolation_failures_total", { check: "tenant_fence" }) > 0],
      ["api-refusals", "API requests refused for their key (401)", count(apiRefused), false],
      ["auth-refusals", "internal connections refused by the cluster handshake", count(sum(samples, "bulkhead:auth_refusals_total")), false],
      ["handshake-refusals", "internal connections closed before they authenticated", count(sum(samples, "bulkhead:handshake_refusals_total")), false],
      ["bad-connections", "connections closed for bad bytes", count(sum(samples, "bulkhead:bad_connections_total")), false],
      ["rejected", "requests refused at admission", count(sum(samples, "bulkhead:rejected_admissions_total")), false],
    ];
    const rows = items.map(([id, what, value, bad]) => {
      const tr = el("tr");
      tr.dataset.k = id;
      tr.append(cell(what, "what"), cell(value, "num" + (bad ? " bad" : "")));
      return tr;
    });
    $("evidence").replaceChildren(...rows);
  }

  function render() {
    const samples = history[history.length - 1].samples;
    const tokens = sum(samples, "bulkhead:generation_tokens_total");
    // Tokens as they stream: each first token and each gap after one is an observation of a
    // gateway histogram, so this moves while requests run (generation_tokens_total only
    // counts finished requests).
    const streamed = rate("bulkhead:time_to_first_token_seconds_count") + rate("bulkhead:inter_token_latency_seconds_count");
    set("tokens-per-s", count(streamed || 0));
    set("tokens-total", `${count(tokens)} generated`);
    set("running", count(sum(samples, "bulkhead:num_requests_running")));
    const ok = sum(samples, "bulkhead:request_success_total");
    const failed = sum(samples, "bulkhead:request_failure_total");
    set("finished", `${count(ok)} finished · ${count(failed)} failed`);
    set("queue", `${count(sum(samples, "bulkhead:num_requests_waiting"))} · ${count(sum(samples, "bulkhead:num_requests_queued"))}`);
    set("queue-wait", `longest wait ${seconds(sum(samples, "bulkhead:queue_wait_seconds_max"))}`);
    const [ttft, ttftWindow] = percentiles("bulkhead:time_to_first_token_seconds");
    set("ttft", ttft);
    set("ttft-window", ttftWindow);
    const [itl, itlWindow] = percentiles("bulkhead:inter_token_latency_seconds");
    set("itl", itl);
    set("itl-window", itlWindow);
    const failures = sum(samples, "bulkhead:isolation_failures_total");
    set("failures", count(failures));
    $("failures").classList.toggle("bad", failures > 0);
    $("failures").classList.toggle("ok", failures === 0);
    renderPools(samples);
    renderChecks(samples);
    renderEvidence(samples);
  }

  async function poll() {
    try {
      const r = await fetch("/metrics", { cache: "no-store" });
      if (!r.ok) throw new Error(`${r.status} ${r.statusText}`);
      const samples = parse(await r.text());
      const key = sessionStorage.getItem(ADMIN_KEY_STORE);
      operator = false;
      if (key) {
        const o = await fetch("/metrics/tenants", { cache: "no-store", headers: { Authorization: `Bearer ${key}` } });
        if (o.ok) {
          samples.push(...parse(await o.text()));
          operator = true;
        } else if (o.status === 401) sessionStorage.removeItem(ADMIN_KEY_STORE);
      }
      $("operator").hidden = operator;
      const t = performance.now();
      history.push({ t, samples });
      while (history.length > 2 && t - history[1].t > LATENCY_WINDOW_MS) history.shift();
      render();
      const workersUp = sum(samples, "bulkhead:workers");
      set("status", `live · ${count(workersUp)} workers · ${new Date().toLocaleTimeString()}`);
      $("status").classList.remove("down");
    } catch (e) {
      set("status", "metrics unreachable: " + e.message);
      $("status").classList.add("down");
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  $("operator").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const k = $("admin-key").value.trim();
    if (k) sessionStorage.setItem(ADMIN_KEY_STORE, k);
    $("admin-key").value = "";
  });

  poll();
})();
