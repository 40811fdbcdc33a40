"use strict";
// The Conveyor dashboard: reads /dashboard/ws (gateway/dashboard.py) and draws what the engine reports
// (engine/observe/dashboard.py has the message layout). Plain DOM and canvas; nothing is fetched from elsewhere.
(() => {
  const STRIP = 300;          // steps in the step strip
  const WINDOW = 300;         // seconds the charts cover
  const $ = (id) => document.getElementById(id);
  const steps = [];           // rows: [step, t, prefill, decode, seqs, seconds, preempted, swapOut, swapIn, sampled]
  const buckets = new Map();  // whole second -> {sampled, ttft[], itl[], kv, pq, ph, sd, sa}
  let last = null;            // the previous snapshot's stats, for rates of counters
  let lastStep = 0;
  let cells = [], cpuCells = [];

  const params = new URLSearchParams(location.search);
  const key = params.get("api_key");

  function connect() {
    const url = new URL("/dashboard/ws", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    if (key) url.searchParams.set("api_key", key);
    if (params.get("replica")) url.searchParams.set("replica", params.get("replica"));
    const ws = new WebSocket(url);
    ws.onopen = () => setStatus(true);
    ws.onclose = () => { setStatus(false); setTimeout(connect, 1000); };
    ws.onmessage = (ev) => receive(JSON.parse(ev.data));
  }

  // Which engine this page shows; with several data-parallel replicas, a choice of the others
  // (a new page for the one picked: its blocks and queues are another engine's).
  function showReplica(r) {
    const pick = $("replica");
    pick.replaceChildren(...r.addresses.map((a, i) => new Option(`${i}: ${a}`, String(i))));
    pick.value = String(r.index);
    $("replica-pick").hidden = r.addresses.length < 2;
    pick.onchange = () => {
      params.set("replica", pick.value);
      location.search = params.toString();
    };
  }

  function setStatus(up) {
    const s = $("status");
    s.textContent = up ? "live" : "disconnected";
    s.className = "status " + (up ? "up" : "down");
  }

  function bucket(t) {
    const sec = Math.floor(t);
    let b = buckets.get(sec);
    if (!b) {
      b = {sampled: 0, ttft: [], itl: [], kv: null, pq: 0, ph: 0, sd: 0, sa: 0};
      buckets.set(sec, b);
      for (const k of buckets.keys()) if (k < sec - WINDOW) buckets.delete(k);
    }
    return b;
  }

  function receive(msg) {
    if (msg.hello) {
      $("model").textContent = msg.hello.model;
      showReplica(msg.hello.replica);
      return;
    }
    const now = Date.now() / 1000;
    for (const row of msg.steps) {
      steps.push(row);
      bucket(row[1]).sampled += row[9];
      lastStep = Math.max(lastStep, row[0]);
    }
    if (steps.length > STRIP) steps.splice(0, steps.length - STRIP);
    const b = bucket(now);
    b.ttft.push(...msg.ttft);
    b.itl.push(...msg.itl);
    if (msg.snapshot) snapshot(msg.snapshot, bucket(msg.snapshot.t));
    $("step").textContent = lastStep;
    drawStrip();
    drawCharts(now);
  }

  function snapshot(s, b) {
    lastStep = Math.max(lastStep, s.step);
    const st = s.stats;
    for (const q of ["running", "swapped", "waiting"]) $("count-" + q).textContent = s.counts[q];
    $("kv-used").textContent = st.num_blocks - st.num_free_blocks;
    $("kv-total").textContent = st.num_blocks;
    $("cpu-used").textContent = st.num_cpu_blocks - st.num_free_cpu_blocks;
    $("cpu-total").textContent = st.num_cpu_blocks;
    $("kv-shared").textContent = s.shared.length;
    b.kv = st.kv_usage;
    if (last) {
      b.pq += (st.total_prefix_queries_tokens || 0) - (last.total_prefix_queries_tokens || 0);
      b.ph += (st.total_prefix_hits_tokens || 0) - (last.total_prefix_hits_tokens || 0);
      b.sd += (st.total_spec_draft_tokens || 0) - (last.total_spec_draft_tokens || 0);
      b.sa += (st.total_spec_accepted_tokens || 0) - (last.total_spec_accepted_tokens || 0);
    }
    if ("spec_acceptance_rate" in st) $("spec-figure").hidden = false;
    last = st;
    const shared = new Map(s.shared);
    cells = drawPool($("blocks"), cells, s.blocks, s.holders, shared);
    cpuCells = drawPool($("cpu-blocks"), cpuCells, s.cpu_blocks, s.holders, new Map());
    drawQueues(s);
  }

  function hue(text) {
    let h = 0;
    for (let i = 0; i < text.length; i++) h = (h * 31 + text.charCodeAt(i)) >>> 0;
    return (h * 137.508) % 360;
  }

  function colour(rid) { return rid === undefined ? "#8a8f96" : `hsl(${hue(rid).toFixed(0)} 65% 55%)`; }

  function drawPool(grid, cells, holders, names, shared) {
    if (cells.length !== holders.length) {
      grid.textContent = "";
      grid.classList.toggle("big", holders.length <= 512);
      cells = holders.map((_, i) => {
        const c = document.createElement("i");
        c.dataset.block = i;
        grid.appendChild(c);
        return c;
      });
    }
    holders.forEach((h, i) => {
      const c = cells[i];
      const rc = shared.get(i);
      const cls = h === -2 ? "cell free" : h === -1 ? "cell cached" : rc ? "cell used shared" : "cell used";
      if (c.className !== cls) c.className = cls;
      const bg = h >= 0 ? colour(names[h]) : "";
      if (c.style.background !== bg) c.style.background = bg;
      c.dataset.holder = h >= 0 ? (names[h] ?? "") : "";
      c.title = h >= 0 ? `block ${i}: ${names[h] ?? "in transit"}${rc ? ` (ref count ${rc})` : ""}`
        : `block ${i}: ${h === -1 ? "free, cached prefix" : "free"}`;
    });
    return cells;
  }

  function td(text, cls) {
    const el = document.createElement("td");
    if (cls) el.className = cls;
    if (text instanceof Node) el.appendChild(text); else el.textContent = text;
    return el;
  }

  function drawQueues(s) {
    const bodies = {running: [], swapped: [], waiting: []};
    for (const [label, queue, computed, prompt, generated, maxTokens, priority, preempted, cached, holder] of s.seqs) {
      const tr = document.createElement("tr");
      tr.dataset.state = queue;
      const name = document.createElement("span");
      const sw = document.createElement("i");
      sw.className = "swatch";
      sw.style.background = colour(s.holders[holder]);
      name.append(sw, label);
      const state = document.createElement("span");
      state.textContent = queue;
      const bar = document.createElement("span");
      const barOuter = document.createElement("span");
      barOuter.className = "bar";
      const fill = document.createElement("i");
      fill.style.width = (100 * computed / Math.max(1, prompt)).toFixed(0) + "%";
      barOuter.appendChild(fill);
      bar.append(barOuter, `${computed} / ${prompt}`);
      const hit = document.createElement("span");
      hit.textContent = cached ? `${cached} tokens` : "-";
      if (cached) hit.className = "hit";
      tr.append(td(name), td(state, "state"), td(bar), td(`${generated} / ${maxTokens}`), td(String(priority)),
                td(String(preempted)), td(hit));
      bodies[queue].push(tr);
    }
    for (const q of Object.keys(bodies)) $("queue-" + q).replaceChildren(...bodies[q]);
  }

  function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

  function drawStrip() {
    const cv = $("strip"), g = cv.getContext("2d");
    const W = cv.width, H = cv.height, top = 12, h = H - top;
    g.clearRect(0, 0, W, H);
    if (!steps.length) return;
    const bw = W / STRIP;
    const maxTok = Math.max(1, ...steps.map((r) => r[2] + r[3]));
    const maxTime = Math.max(1e-6, ...steps.map((r) => r[5]));
    const x0 = W - steps.length * bw;
    steps.forEach((r, i) => {
      const x = x0 + i * bw;
      const hp = h * r[2] / maxTok, hd = h * r[3] / maxTok;
      g.fillStyle = css("--decode"); g.fillRect(x, H - hd, Math.max(1, bw - 1), hd);
      g.fillStyle = css("--prefill"); g.fillRect(x, H - hd - hp, Math.max(1, bw - 1), hp);
      if (r[6]) { g.fillStyle = css("--preempt"); g.fillRect(x, 0, Math.max(2, bw - 1), 5); }
      if (r[7] || r[8]) { g.fillStyle = css("--swap"); g.fillRect(x, 6, Math.max(2, bw - 1), 5); }
    });
    g.strokeStyle = css("--time"); g.lineWidth = 1; g.beginPath();
    steps.forEach((r, i) => {
      const x = x0 + (i + 0.5) * bw, y = H - h * r[5] / maxTime;
      if (i) g.lineTo(x, y); else g.moveTo(x, y);
    });
    g.stroke();
    const lastRow = steps[steps.length - 1];
    $("strip-info").textContent = `step ${lastRow[0]}: ${lastRow[2]} prefill + ${lastRow[3]} decode tokens, ` +
      `${lastRow[4]} sequences, ${(lastRow[5] * 1000).toFixed(1)} ms; tallest bar ${maxTok} tokens, ` +
      `slowest step ${(maxTime * 1000).toFixed(1)} ms`;
  }

  function pct(xs, p) {
    if (!xs.length) return null;
    const s = [...xs].sort((a, b) => a - b);
    return s[Math.min(s.length - 1, Math.floor(p * s.length))];
  }

  function drawCharts(now) {
    const end = Math.floor(now), secs = [];
    for (let t = end - WINDOW + 1; t <= end; t++) secs.push(buckets.get(t));
    const series = (f) => secs.map((b) => (b ? f(b) : null));
    line("chart-tps", [{ys: series((b) => b.sampled), colour: css("--decode")}]);
    line("chart-ttft", [{ys: series((b) => pct(b.ttft, 0.5)), colour: css("--decode")},
                        {ys: series((b) => pct(b.ttft, 0.99)), colour: css("--preempt")}]);
    line("chart-itl", [{ys: series((b) => pct(b.itl, 0.5)), colour: css("--decode")},
                       {ys: series((b) => pct(b.itl, 0.99)), colour: css("--preempt")}]);
    line("chart-kv", [{ys: series((b) => b.kv), colour: css("--prefill")}], 1);
    line("chart-prefix", [{ys: series((b) => (b.pq ? b.ph / b.pq : null)), colour: css("--swap")}], 1);
    line("chart-spec", [{ys: series((b) => (b.sd ? b.sa / b.sd : null)), colour: css("--decode")}], 1);
  }

  function line(id, lines, fixedMax) {
    const cv = $(id), g = cv.getContext("2d"), W = cv.width, H = cv.height, pad = 14;
    g.clearRect(0, 0, W, H);
    const all = lines.flatMap((l) => l.ys.filter((y) => y !== null));
    const max = fixedMax || Math.max(1e-9, ...all) * 1.1;
    g.fillStyle = css("--dim"); g.font = "10px sans-serif";
    g.fillText(all.length ? `max ${(fixedMax || Math.max(...all)).toPrecision(3)}` : "no data yet", 4, 10);
    for (const l of lines) {
      g.strokeStyle = l.colour; g.beginPath();
      let pen = false;
      l.ys.forEach((y, i) => {
        if (y === null) { pen = false; return; }
        const x = W * i / (l.ys.length - 1), yy = H - (H - pad) * y / max;
        if (pen) g.lineTo(x, yy); else g.moveTo(x, yy);
        pen = true;
      });
      g.stroke();
    }
  }

  connect();
})();
