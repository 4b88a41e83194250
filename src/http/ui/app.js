// The delayd dashboard: plain JavaScript on the JSON API under /v1.
//
// Every value from the server reaches the page through textContent (never as markup), so a topic
// name or a message body cannot inject script. The token lives in sessionStorage and travels only
// in the Authorization header. Paths are relative to /ui, so the page also works behind a proxy
// that serves delayd under a prefix.
//
// In a cluster only the leader answers the API (other nodes answer 307 to it, or 503 no_leader).
// The page never follows those redirects: the leader is another origin, which the policy forbids
// and which would not get the token. It asks its own node's /v1/cluster first and, on a node
// that does not lead, shows where the leader is and greys the rest.
'use strict';

(function () {
  const TOKEN_KEY = 'delayd.token';
  const REFRESH_MS = 5000;
  const PAGE_SIZE = 50;
  const BODY_PREVIEW_CHARS = 160;
  const BODY_FULL_CHARS = 4000;
  const DELAYED_PAGE = 200; // within the smallest max_batch a server is likely to have
  const DELAYED_MAX = 1000;
  const PUSH_LOOKUPS = 100; // topics whose push health is asked for on each refresh

  const $ = (id) => document.getElementById(id);
  const enc = encodeURIComponent;

  let timer = null;
  let needToken = false;
  let refreshFailed = false;
  let browsing = null; // {topic, state, cursor} of the list on screen
  let lookedUp = null; // id of the message on screen

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  function token() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch (_) {
      return null; // storage disabled: the page still works without a token
    }
  }

  async function api(method, path, body) {
    const headers = { Accept: 'application/json' };
    const t = token();
    if (t) headers.Authorization = 'Bearer ' + t;
    const init = { method, headers, cache: 'no-store', credentials: 'omit', redirect: 'manual' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, 'network', 'delayd did not answer (' + e.message + ')');
    }
    if (resp.type === 'opaqueredirect') {
      throw new ApiError(307, 'not_leader', 'This node does not lead: the leader answers that (see the banner).');
    }
    let data = null;
    try {
      data = await resp.json();
    } catch (_) {
      data = null;
    }
    if (resp.ok) return data;
    const err = (data && data.error) || {};
    if (resp.status === 401) askToken(t ? 'The token was refused. Enter it again.' : null);
    throw new ApiError(resp.status, err.code || 'http_' + resp.status, err.message || 'HTTP ' + resp.status);
  }

  // An endpoint this server does not have (yet): an older delayd answers 404 no_such_endpoint,
  // or 405 where the path exists for another method.
  function unavailable(e) {
    return e instanceof ApiError && (e.status === 405 || e.code === 'no_such_endpoint');
  }

  // Leadership moved between two calls: the node sent this one on, or has no leader to send it to.
  function notLeading(e) {
    return e instanceof ApiError && (e.code === 'not_leader' || e.code === 'no_leader');
  }

  function h(tag, props, ...kids) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === false || v === null || v === undefined) continue;
      if (k === 'class') el.className = v;
      else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
      else if (k === 'key') el.dataset.key = v;
      else el.setAttribute(k, v === true ? '' : v);
    }
    for (const kid of kids) if (kid !== null && kid !== undefined) el.append(kid instanceof Node ? kid : String(kid));
    return el;
  }

  function say(text, isError) {
    const s = $('status');
    s.textContent = text;
    s.classList.toggle('error', !!isError);
  }

  function report(e) {
    if (e instanceof ApiError && e.status === 401) return; // the token form says it
    say(e.message || String(e), true);
  }

  // ---- formatting ----

  function fmtDuration(ms) {
    const units = [['d', 86400000], ['h', 3600000], ['m', 60000], ['s', 1000]];
    for (const [u, n] of units) if (ms >= n && ms % n === 0) return ms / n + u;
    return ms + 'ms';
  }

  function fmtSpan(ms) {
    const s = Math.round(ms / 1000);
    if (ms < 1000) return ms + ' ms';
    if (s < 60) return s + ' s';
    if (s < 3600) return Math.floor(s / 60) + ' min ' + (s % 60) + ' s';
    if (s < 86400) return Math.floor(s / 3600) + ' h ' + Math.floor((s % 3600) / 60) + ' min';
    return Math.floor(s / 86400) + ' d ' + Math.floor((s % 86400) / 3600) + ' h';
  }

  function fmtBytes(n) {
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return (i ? n.toFixed(1) : n) + ' ' + units[i];
  }

  // A unix-ms time as "in 42 s · 2026-11-23 05:19:40Z" (UTC, as delayd-cli prints it).
  function when(ms) {
    if (ms === null || ms === undefined) return '—';
    const iso = new Date(ms).toISOString();
    const d = ms - Date.now();
    const rel = Math.abs(d) < 1000 ? 'now' : d > 0 ? 'in ' + fmtSpan(d) : fmtSpan(-d) + ' ago';
    return h('time', { datetime: iso }, rel + ' · ' + iso.replace('T', ' ').replace(/\.\d+Z$/, 'Z'));
  }

  // "14:05:09Z": a time of day in UTC, as every time on this page is.
  function utcClock(ms) {
    return new Date(ms).toISOString().slice(11, 19) + 'Z';
  }

  function preview(body, max) {
    const text = body === null || body === undefined ? '' : String(body);
    return text.length > max ? text.slice(0, max) + '… (' + text.length + ' characters)' : text;
  }

  // ---- auth ----

  function askToken(why) {
    const first = !needToken;
    needToken = true;
    $('auth').hidden = false;
    $('auth-why').textContent = why || 'This server is set up with an auth_token. Enter it to see its data.';
    $('forget').hidden = !token();
    say('A token is needed to read this server.', false);
    if (first) $('token').focus();
  }

  function useToken(ev) {
    ev.preventDefault();
    const value = $('token').value.trim();
    if (!value) return;
    try {
      sessionStorage.setItem(TOKEN_KEY, value);
    } catch (_) {
      say('This browser does not allow session storage, so the token cannot be kept.', true);
      return;
    }
    $('token').value = '';
    needToken = false;
    $('auth').hidden = true;
    $('forget').hidden = false;
    say('Token set.', false);
    refresh();
  }

  function forgetToken() {
    try {
      sessionStorage.removeItem(TOKEN_KEY);
    } catch (_) {
      // nothing was kept
    }
    $('forget').hidden = true;
    refresh();
  }

  // ---- levels ----

  let lastStats = null;

  function renderLevels(stats) {
    lastStats = stats;
    const all = stats.levels || [];
    const showIdle = $('idle-levels').checked;
    const rows = all.filter((l) => showIdle || l.backlog > 0).map((l) =>
      h('tr', { class: l.backlog > 0 ? null : 'idle', 'data-level-ms': l.level_ms },
        h('td', null, fmtDuration(l.level_ms)),
        h('td', { class: 'num' }, l.backlog),
        h('td', null, when(l.next_due_ms))));
    $('levels').tBodies[0].replaceChildren(...rows);
    $('levels').hidden = rows.length === 0;
    $('levels-empty').hidden = rows.length > 0;
    const parts = [];
    if (typeof stats.disk_bytes === 'number') parts.push('Disk ' + fmtBytes(stats.disk_bytes));
    if (typeof stats.live_bytes === 'number') parts.push('live ' + fmtBytes(stats.live_bytes));
    if (typeof stats.open_queues === 'number') parts.push(stats.open_queues + ' open queues');
    parts.push('updated ' + utcClock(Date.now()));
    $('summary').textContent = parts.join(' · ');
  }

  // ---- health and charts ----

  // The SVG namespace, from the page's own chart (the HTML parser sets it), so no URL is written here.
  const SVG = $('chart-rates').namespaceURI;
  const HOUR_MS = 3600000;
  const RATES = [['produced', 'produced_per_s'], ['delivered', 'delivered_per_s'], ['acked', 'acked_per_s'],
    ['nacked', 'nacked_per_s'], ['dead-lettered', 'dead_lettered_per_s']];
  const LATENESS = [['p50', 'lateness_p50_ms'], ['p99', 'lateness_p99_ms']];

  // The strip and the charts; an older delayd without /v1/stats/history shows neither.
  async function refreshHistory(stats) {
    let hist;
    try {
      hist = await api('GET', 'v1/stats/history');
    } catch (e) {
      if (!unavailable(e)) throw e;
      hist = null;
    }
    ages = new Map(((hist && hist.topics) || []).map((t) => [t.topic, t.oldest_ready_age_ms]));
    renderHealth(stats, hist);
    $('charts').hidden = !hist;
    if (hist) renderCharts(hist);
  }

  function renderHealth(stats, hist) {
    const p = (hist && hist.process) || {};
    const writable = stats.store_writable !== false;
    const facts = [
      ['store', 'Store', h('span', { class: 'badge ' + (writable ? 'ok' : 'bad') },
        writable ? 'writable' : 'not writable'),
      writable ? null : ' ' + (stats.store_error || 'no reason given')],
      ['version', 'Version', p.version || '—'],
      ['uptime', 'Uptime', p.uptime_ms === undefined ? '—'
        : fmtSpan(p.uptime_ms) + ' · since ' + isoUtc(p.started_at_ms)],
      ['disk-free', 'Disk free', typeof p.data_disk_free_bytes === 'number' ? fmtBytes(p.data_disk_free_bytes) : '—'],
      ['disk-used', 'Data', typeof stats.disk_bytes === 'number' ? fmtBytes(stats.disk_bytes) : '—'],
      ['updated', 'Updated', utcClock(Date.now())],
    ];
    $('health-facts').replaceChildren(...facts.map(([key, k, ...v]) =>
      h('div', { class: key === 'store' && !writable ? 'alarm' : null },
        h('dt', null, k), h('dd', { 'data-fact': key }, ...[].concat(...v).filter((x) => x !== null)))));
    $('health').hidden = false;
  }

  function renderCharts(hist) {
    const samples = hist.samples || [];
    const empty = $('charts-empty');
    empty.hidden = samples.length > 0;
    empty.textContent = samples.length ? '' : 'Collecting: the first sample comes ' +
      fmtSpan(hist.interval_ms || 10000) + ' after the start.';
    const now = Date.now();
    drawChart($('chart-rates'), $('legend-rates'), samples, RATES, now, (v) => fmtRate(v) + '/s');
    drawChart($('chart-lateness'), $('legend-lateness'), samples, LATENESS, now, (v) => fmtRate(v) + ' ms');
  }

  function fmtRate(v) {
    if (v === null || v === undefined) return '—';
    return v >= 100 ? String(Math.round(v)) : v >= 10 ? v.toFixed(1) : v.toFixed(2).replace(/\.?0+$/, '') || '0';
  }

  function svg(tag, attrs, text) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (text !== undefined) el.textContent = text;
    return el;
  }

  // The largest of 1, 2 or 5 times a power of ten that is at least `v`: round axis labels.
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  // A line per series (x: UTC time, y: from 0), a gap where a value is null. The x axis spans
  // the samples there are, at least five minutes and at most the hour kept, ending now.
  function drawChart(el, legend, samples, series, now, fmt) {
    const [W, H, L, R, T, B] = [640, 200, 48, 8, 8, 22];
    const first = samples.length ? samples[0].time_ms : now;
    const span = Math.min(HOUR_MS, Math.max(5 * 60000, now - first + 20000));
    const x0 = now - span;
    let max = 0;
    for (const s of samples) for (const [, k] of series) if (typeof s[k] === 'number') max = Math.max(max, s[k]);
    const top = niceMax(max);
    const x = (t) => L + ((t - x0) / span) * (W - L - R);
    const y = (v) => H - B - (v / top) * (H - T - B);
    const kids = [];
    for (const f of [0, 0.5, 1]) {
      kids.push(svg('line', { class: 'grid', x1: L, x2: W - R, y1: y(top * f), y2: y(top * f) }));
      kids.push(svg('text', { class: 'axis', x: L - 4, y: y(top * f) + 4, 'text-anchor': 'end' },
        Number.isInteger(top * f) ? String(top * f) : fmtRate(top * f)));
    }
    // Ticks on round minutes (at most six), labelled in UTC.
    const q = [1, 2, 5, 10, 15].map((m) => m * 60000).find((m) => span / m <= 6) || 15 * 60000;
    for (let t = Math.ceil(x0 / q) * q; t <= now; t += q) {
      kids.push(svg('line', { class: 'grid', x1: x(t), x2: x(t), y1: T, y2: H - B }));
      kids.push(svg('text', { class: 'axis', x: x(t), y: H - 6, 'text-anchor': 'middle' },
        new Date(t).toISOString().slice(11, 16) + 'Z'));
    }
    const items = [];
    series.forEach(([name, k], i) => {
      let run = [];
      const runs = [run];
      for (const s of samples) {
        if (s.time_ms < x0) continue;
        if (typeof s[k] !== 'number') {
          if (run.length) runs.push((run = []));
          continue;
        }
        run.push(x(s.time_ms).toFixed(1) + ',' + y(s[k]).toFixed(1));
      }
      for (const r of runs.filter((r) => r.length)) {
        kids.push(svg('polyline', { class: 'line s' + i, 'data-series': name, points: r.join(' ') }));
        // A lone point (the first sample, or one between gaps) has no line: a dot shows it.
        if (r.length === 1) {
          const [cx, cy] = r[0].split(',');
          kids.push(svg('circle', { class: 'dot s' + i, 'data-series': name, cx, cy, r: 3 }));
        }
      }
      const last = samples.length ? samples[samples.length - 1][k] : null;
      items.push(h('li', { 'data-series': name }, h('span', { class: 'swatch s' + i }), name + ' ',
        h('strong', null, last === null || last === undefined ? '—' : fmt(last))));
    });
    el.replaceChildren(...kids);
    legend.replaceChildren(...items);
  }

  // ---- topics ----

  async function refreshTopics(stats) {
    let topics;
    let full = true;
    try {
      topics = (await api('GET', 'v1/topics')).topics || [];
    } catch (e) {
      if (!unavailable(e)) throw e;
      full = false;
      topics = (stats.topics || []).map((t) => Object.assign({}, t, { delayed: null, paused: null }));
    }
    const note = $('topics-note');
    note.hidden = full;
    note.textContent = full ? '' : 'Not available on this server: GET /v1/topics. Counts come from /v1/stats; ' +
      'delayed counts, pause/resume, redrive and purge need the newer endpoints.';
    lastTopics = { topics, full };
    const shown = filtered(topics);
    await refreshPush(shown.filter((t) => !t.topic.endsWith('.dlq')).slice(0, PUSH_LOOKUPS));
    renderTopics(topics, full);
  }

  let lastTopics = null; // {topics, full}, to filter again without asking the server
  let ages = new Map(); // topic -> oldest ready age (ms) or null, from /v1/stats/history
  let pushes = new Map(); // topic -> its push subscription, or null without one

  function filtered(topics) {
    const f = $('topic-filter').value.trim().toLowerCase();
    return f ? topics.filter((t) => t.topic.toLowerCase().includes(f)) : topics;
  }

  // Each listed topic's push subscription and its health; a topic without one answers 404.
  async function refreshPush(topics) {
    const next = new Map();
    await Promise.all(topics.map(async (t) => {
      try {
        next.set(t.topic, await api('GET', 'v1/topics/' + enc(t.topic) + '/push'));
      } catch (e) {
        if (e.status === 404 || unavailable(e)) next.set(t.topic, null);
        else if (pushes.has(t.topic)) next.set(t.topic, pushes.get(t.topic));
      }
    }));
    pushes = next;
  }

  function pushCell(topic) {
    const p = pushes.get(topic);
    if (!p) return '—';
    const target = p.url || (p.nats ? p.nats.url + ' → ' + p.nats.subject : '');
    const failing = p.consecutive_failures > 0;
    const parts = [h('span', { class: 'badge ' + (failing ? 'bad' : 'ok'), 'data-push': failing ? 'failing' : 'ok' },
      failing ? 'failing ×' + p.consecutive_failures : 'ok'),
    ' ' + (p.delivered_1m ?? 0) + ' ok / ' + (p.failed_1m ?? 0) + ' failed in 1 min'];
    if (p.last_success_ms) parts.push(h('br'), 'last success ', ago(p.last_success_ms, '—'));
    if (p.last_error) {
      parts.push(h('br'), h('span', { class: 'err' }, 'last error ', ago(p.last_error.time_ms, '—'), ': ' +
        preview(p.last_error.message, 120)));
    }
    return h('span', { title: target }, ...parts);
  }

  function ageCell(topic) {
    const a = ages.get(topic);
    if (a === null || a === undefined) return '—';
    return h('span', { class: a >= 60000 ? 'warn' : null }, fmtSpan(a));
  }

  function renderTopics(all, full) {
    const topics = filtered(all);
    const names = new Set(all.map((t) => t.topic));
    const rows = topics.map((t) => {
      const isDlq = t.topic.endsWith('.dlq');
      const base = isDlq ? t.topic.slice(0, -4) : t.topic;
      // A dead-letter topic gets the redrive and purge buttons on its own row; its base topic
      // gets them only when that row is not listed, so each pair shows once.
      const dlqActions = full && (isDlq || (t.dead_lettered > 0 && !names.has(t.topic + '.dlq')));
      const actions = h('td', { class: 'actions' },
        h('button', { type: 'button', key: 'browse:' + t.topic, 'aria-label': 'Browse ' + t.topic,
          onclick: () => startBrowse(t.topic) }, 'Browse'),
        full && !isDlq ? h('button', { type: 'button', key: 'flow:' + t.topic, 'aria-label': 'Flow control of ' + t.topic,
          onclick: () => editFlow(t) }, 'Flow') : null,
        full ? h('button', { type: 'button', key: 'pause:' + t.topic,
          'aria-label': (t.paused ? 'Resume ' : 'Pause ') + t.topic,
          onclick: () => setPaused(t.topic, !t.paused) }, t.paused ? 'Resume' : 'Pause') : null,
        dlqActions ? h('button', { type: 'button', key: 'redrive:' + t.topic,
          'aria-label': 'Redrive ' + base + '.dlq to ' + base, onclick: () => redrive(base) }, 'Redrive') : null,
        dlqActions ? h('button', { type: 'button', class: 'danger', key: 'purge:' + t.topic,
          'aria-label': 'Purge ' + base + '.dlq', onclick: () => purge(base + '.dlq') },
        isDlq ? 'Purge' : 'Purge DLQ') : null);
      const state = t.paused === null || t.paused === undefined ? '—'
        : h('span', { class: 'badge' + (t.paused ? ' paused' : '') }, t.paused ? 'paused' : 'active');
      return h('tr', { 'data-topic': t.topic },
        h('th', { scope: 'row' }, h('code', null, t.topic)),
        h('td', { class: 'num', 'data-label': 'Ready' }, t.ready),
        h('td', { class: 'num', 'data-label': 'Reserved' }, t.reserved),
        h('td', { class: 'num', 'data-label': 'Delayed' },
          t.delayed === null || t.delayed === undefined ? '—' : t.delayed),
        h('td', { class: 'num', 'data-label': 'Dead-lettered' }, t.dead_lettered),
        h('td', { 'data-label': 'Oldest ready', 'data-age': true }, ageCell(t.topic)),
        h('td', { 'data-label': 'Push', 'data-push-cell': true }, pushCell(t.topic)),
        h('td', { 'data-label': 'State' }, state, t.flow ? h('br') : null, flowBadge(t.flow)),
        actions);
    });
    replaceKeepingFocus($('topics').tBodies[0], rows);
    renderTotals(topics, all.length);
    $('topics-empty').hidden = rows.length > 0;
    $('topics-empty').textContent = all.length ? 'No topic matches the filter.' : 'No topics yet.';
  }

  // One row of sums over the topics shown, which says how many the filter left.
  function renderTotals(topics, of) {
    const sum = (k) => topics.reduce((n, t) => n + (typeof t[k] === 'number' ? t[k] : 0), 0);
    const noun = of === 1 ? ' topic)' : ' topics)';
    const label = 'Total (' + (topics.length === of ? '' : topics.length + ' of ') + of + noun;
    const row = h('tr', { id: 'topics-total-row' },
      h('th', { scope: 'row' }, label),
      ...['ready', 'reserved', 'delayed', 'dead_lettered'].map((k) =>
        h('td', { class: 'num', 'data-label': k.replace('_', '-') }, sum(k))),
      h('td', { colspan: 4 }));
    $('topics-total').replaceChildren(...(of ? [row] : []));
  }

  // The table is rebuilt on every refresh; a keyboard user keeps focus on the same button.
  function replaceKeepingFocus(parent, children) {
    const key = document.activeElement && parent.contains(document.activeElement)
      ? document.activeElement.dataset.key : null;
    parent.replaceChildren(...children);
    if (key) {
      const again = Array.from(parent.querySelectorAll('button')).find((b) => b.dataset.key === key);
      if (again) again.focus();
    }
  }

  async function topicAction(verb, topic, doneText) {
    try {
      const r = await api('POST', 'v1/topics/' + enc(topic) + '/' + verb, {});
      say(doneText(r || {}), false);
    } catch (e) {
      if (unavailable(e)) say('Not available on this server: POST /v1/topics/{topic}/' + verb + '.', true);
      else report(e);
    }
    refresh();
  }

  // ---- flow control ----

  function flowText(f) {
    const parts = [];
    if (f.max_per_second) parts.push('≤ ' + f.max_per_second + '/s (burst ' + f.burst + ')');
    if (f.max_reserved) parts.push('≤ ' + f.max_reserved + ' reserved');
    return parts.join(', ');
  }

  function flowBadge(f) {
    return f ? h('span', { class: 'badge flow', 'data-flow': true, title: 'Flow control' }, flowText(f)) : null;
  }

  // Fills the form with the topic's flow control (empty fields where it has no such limit).
  function editFlow(t) {
    const f = t.flow || {};
    $('flow-topic').value = t.topic;
    $('flow-rate').value = f.max_per_second || '';
    $('flow-burst').value = f.max_per_second ? f.burst : '';
    $('flow-reserved').value = f.max_reserved || '';
    $('flow').scrollIntoView({ block: 'start' });
    $('flow-rate').focus();
  }

  async function saveFlow(ev) {
    ev.preventDefault();
    const topic = $('flow-topic').value.trim();
    const body = {};
    for (const [id, key] of [['flow-rate', 'max_per_second'], ['flow-burst', 'burst'], ['flow-reserved', 'max_reserved']]) {
      const v = $(id).value.trim();
      if (v) body[key] = Number(v);
    }
    if (!topic) return;
    try {
      const r = await api('PUT', 'v1/topics/' + enc(topic) + '/flow', body);
      say('Flow control of ' + r.topic + ': ' + flowText(r) + '.', false);
    } catch (e) {
      if (unavailable(e)) say('Not available on this server: PUT /v1/topics/{topic}/flow.', true);
      else report(e);
    }
    refresh();
  }

  async function clearFlow() {
    const topic = $('flow-topic').value.trim();
    if (!topic) return;
    try {
      await api('DELETE', 'v1/topics/' + enc(topic) + '/flow');
      say('Flow control of ' + topic + ' removed.', false);
      for (const id of ['flow-rate', 'flow-burst', 'flow-reserved']) $(id).value = '';
    } catch (e) {
      if (e.status === 404) say(topic + ' has no flow control.', true);
      else report(e);
    }
    refresh();
  }

  function setPaused(topic, paused) {
    topicAction(paused ? 'pause' : 'resume', topic, () => topic + (paused ? ' paused.' : ' resumed.'));
  }

  function redrive(base) {
    if (!confirm('Move every message in ' + base + '.dlq back to ' + base + '?')) return;
    topicAction('redrive', base, (r) => 'Redrive: ' + (r.moved ?? 0) + ' moved from ' + base + '.dlq to ' + base + '.');
  }

  function purge(topic) {
    if (!confirm('Cancel every message in ' + topic + '? This cannot be undone.')) return;
    topicAction('purge', topic, (r) => 'Purge: ' + (r.cancelled ?? 0) + ' cancelled in ' + topic + '.');
  }

  // ---- browse ----

  function startBrowse(topic) {
    $('browse-topic').value = topic;
    browse(topic, $('browse-state').value, null);
    $('browse').scrollIntoView({ block: 'start' });
  }

  // Delayed messages come from several level queues, in no one order: up to DELAYED_MAX are read
  // and shown sorted by due time, soonest first. Other states page in queue order.
  async function browse(topic, state, cursor) {
    const note = $('browse-note');
    const table = $('messages');
    let page;
    try {
      page = state === 'delayed' ? await allDelayed(topic) : await browsePage(topic, state, cursor, PAGE_SIZE);
    } catch (e) {
      note.hidden = false;
      table.hidden = true;
      $('more').hidden = true;
      $('bulk').hidden = true;
      note.textContent = unavailable(e) ? 'Not available on this server: GET /v1/topics/{topic}/messages.'
        : e.status === 401 ? 'A token is needed.' : e.message;
      return;
    }
    const tbody = table.tBodies[0];
    if (!cursor) tbody.replaceChildren();
    for (const m of page.messages) tbody.append(messageRow(m));
    browsing = { topic, state, cursor: page.next_cursor || null };
    saveUrl();
    const empty = tbody.rows.length === 0;
    table.hidden = empty;
    note.hidden = !empty;
    note.textContent = empty ? 'No ' + state + ' messages in ' + topic + '.' : '';
    const sorted = $('browse-sorted');
    sorted.hidden = state !== 'delayed' || empty;
    sorted.textContent = state !== 'delayed' ? '' : 'Sorted by due time, soonest first' +
      (page.truncated ? ' (the first ' + DELAYED_MAX + ' read; more are waiting).' : '.');
    $('more').hidden = state === 'delayed' || !browsing.cursor;
    $('bulk-redrive').hidden = state !== 'dead';
    $('bulk-deliver').hidden = state === 'dead' || state === 'reserved';
    $('select-all').checked = false;
    selectionChanged();
  }

  async function browsePage(topic, state, cursor, limit) {
    const q = new URLSearchParams({ state, limit: String(limit) });
    if (cursor) q.set('cursor', cursor);
    const page = await api('GET', 'v1/topics/' + enc(topic) + '/messages?' + q);
    return { messages: page.messages || [], next_cursor: page.next_cursor || null };
  }

  async function allDelayed(topic) {
    const all = [];
    let cursor = null;
    do {
      const page = await browsePage(topic, 'delayed', cursor, DELAYED_PAGE);
      all.push(...page.messages);
      cursor = page.next_cursor;
    } while (cursor && all.length < DELAYED_MAX);
    all.sort((a, b) => a.deliver_at_ms - b.deliver_at_ms || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    return { messages: all.slice(0, DELAYED_MAX), truncated: !!cursor || all.length > DELAYED_MAX };
  }

  function messageRow(m) {
    const act = (label, what, fn, cls) => h('button', { type: 'button', class: cls || null,
      'data-action': what, 'aria-label': label + ' ' + m.id, onclick: () => fn(m) }, label);
    const waiting = m.state === 'delayed' || m.state === 'ready';
    return h('tr', { 'data-id': m.id, 'data-state': m.state },
      h('td', null, h('input', { type: 'checkbox', class: 'pick', 'aria-label': 'Select ' + m.id,
        onchange: selectionChanged })),
      h('td', null, h('button', { type: 'button', class: 'link mono', 'aria-label': 'Look up ' + m.id,
        onclick: () => lookup(m.id) }, m.id)),
      h('td', { 'data-label': 'State' }, m.state),
      h('td', { 'data-label': 'Deliver at', 'data-due': m.deliver_at_ms }, when(m.deliver_at_ms)),
      h('td', { class: 'num', 'data-label': 'Attempt' }, m.attempt),
      h('td', { class: 'body' }, preview(m.body, BODY_PREVIEW_CHARS),
        m.last_error ? h('div', { class: 'err' }, 'last error: ' + preview(m.last_error.message, 120)) : null),
      h('td', { class: 'actions' },
        waiting && m.state === 'delayed' ? act('Deliver now', 'deliver', deliverNow) : null,
        waiting ? act('Reschedule', 'reschedule', reschedule) : null,
        m.state === 'dead' ? act('Redrive', 'redrive', redriveOne) : null,
        act('Cancel', 'cancel', cancelOne, 'danger')));
  }

  // ---- per-message actions ----

  function rebrowse() {
    if (browsing) browse(browsing.topic, browsing.state, null);
    refresh();
  }

  // PATCH /v1/messages/{id}: a new due time for a waiting message, keeping its id.
  async function patchMessage(id, body) {
    try {
      return await api('PATCH', 'v1/messages/' + enc(id), body);
    } catch (e) {
      if (unavailable(e)) {
        throw new ApiError(e.status, 'unavailable', 'Not available on this server: PATCH /v1/messages/{id}.');
      }
      throw e;
    }
  }

  async function deliverNow(m) {
    try {
      const r = await patchMessage(m.id, { delay_ms: 0 });
      say('Message ' + m.id + ' is due now (' + (r && r.state) + ').', false);
    } catch (e) {
      report(e);
    }
    rebrowse();
  }

  // "90s", "15m", "2h", "1d", "500ms" after now, or a time: ISO 8601, taken as UTC without a zone.
  function parseWhen(text) {
    const t = text.trim();
    const d = /^(\d+)\s*(ms|s|m|h|d)$/.exec(t);
    if (d) return { delay_ms: Number(d[1]) * { ms: 1, s: 1000, m: 60000, h: 3600000, d: 86400000 }[d[2]] };
    const iso = /^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:\d{2})?$/i.exec(t);
    if (!iso) return null;
    const ms = Date.parse(t.replace(' ', 'T') + (iso[3] ? '' : 'Z'));
    return Number.isFinite(ms) ? { deliver_at_ms: ms } : null;
  }

  async function reschedule(m) {
    const text = prompt('Deliver ' + m.id + ' when? A delay from now (90s, 15m, 2h, 1d) or a UTC time ' +
      '(2026-12-01 09:00, or with Z or an offset).', '');
    if (text === null || !text.trim()) return;
    const body = parseWhen(text);
    if (!body) {
      say('Not a delay or a time: ' + text + ' (try 15m or 2026-12-01 09:00).', true);
      return;
    }
    try {
      const r = await patchMessage(m.id, body);
      say('Message ' + m.id + ' rescheduled to ' + isoUtc(r.deliver_at_ms) + '.', false);
    } catch (e) {
      report(e);
    }
    rebrowse();
  }

  function isoUtc(ms) {
    return new Date(ms).toISOString().replace('T', ' ').replace(/\.\d+Z$/, 'Z');
  }

  // The dead letter goes back to its topic; browsing is of the topic, its dead letters in .dlq.
  async function redriveIds(ids) {
    const base = browsing.topic.replace(/\.dlq$/, '');
    const r = await api('POST', 'v1/topics/' + enc(base) + '/redrive', { ids });
    return (r && r.moved) || 0;
  }

  async function redriveOne(m) {
    try {
      const moved = await redriveIds([m.id]);
      say('Redrive: ' + moved + ' moved from ' + browsing.topic + '.dlq to ' + browsing.topic + '.', false);
    } catch (e) {
      report(e);
    }
    rebrowse();
  }

  async function cancelOne(m) {
    if (!confirm('Cancel message ' + m.id + '? It will not be delivered.')) return;
    try {
      await api('DELETE', 'v1/messages/' + enc(m.id));
      say('Message ' + m.id + ' cancelled.', false);
    } catch (e) {
      report(e);
    }
    rebrowse();
  }

  // ---- bulk ----

  function picked() {
    return Array.from(document.querySelectorAll('#messages tbody tr'))
      .filter((r) => r.querySelector('input.pick').checked).map((r) => r.dataset.id);
  }

  function selectionChanged() {
    const n = picked().length;
    const rows = $('messages').tBodies[0].rows.length;
    $('bulk').hidden = rows === 0;
    $('bulk-count').textContent = n + ' of ' + rows + ' selected';
    for (const b of $('bulk').querySelectorAll('button')) b.disabled = n === 0;
    $('select-all').checked = n > 0 && n === rows;
  }

  function selectAll() {
    const on = $('select-all').checked;
    for (const c of document.querySelectorAll('#messages tbody input.pick')) c.checked = on;
    selectionChanged();
  }

  // One call per message, one after the other; the result says how many went through.
  async function eachPicked(verb, call) {
    const ids = picked();
    let done = 0;
    let refused = null;
    for (const id of ids) {
      try {
        await call(id);
        done++;
      } catch (e) {
        refused = refused || e;
      }
    }
    const tail = refused ? ', ' + (ids.length - done) + ' refused: ' + refused.message : '.';
    say(verb + ': ' + done + ' of ' + ids.length + tail, !!refused);
    rebrowse();
  }

  function bulkDeliver() {
    eachPicked('Deliver now', (id) => patchMessage(id, { delay_ms: 0 }));
  }

  function bulkCancel() {
    const n = picked().length;
    if (!confirm('Cancel ' + n + ' message' + (n === 1 ? '' : 's') + '? They will not be delivered.')) return;
    eachPicked('Cancel', (id) => api('DELETE', 'v1/messages/' + enc(id)));
  }

  async function bulkRedrive() {
    const ids = picked();
    try {
      const moved = await redriveIds(ids);
      say('Redrive: ' + moved + ' of ' + ids.length + ' moved to ' + browsing.topic + '.', false);
    } catch (e) {
      report(e);
    }
    rebrowse();
  }

  // ---- links ----

  // What is on screen, in the URL's fragment (never the token), so a link opens the same view.
  function saveUrl() {
    const q = new URLSearchParams();
    const f = $('topic-filter').value.trim();
    if (f) q.set('filter', f);
    if (browsing) {
      q.set('topic', browsing.topic);
      q.set('state', browsing.state);
    }
    if (lookedUp) q.set('message', lookedUp);
    const hash = q.toString();
    if (hash !== location.hash.slice(1)) history.replaceState(null, '', hash ? '#' + hash : location.pathname + location.search);
  }

  function restoreUrl() {
    const q = new URLSearchParams(location.hash.slice(1));
    $('topic-filter').value = q.get('filter') || '';
    const state = q.get('state');
    if (state && Array.from($('browse-state').options).some((o) => o.value === state)) $('browse-state').value = state;
    const topic = q.get('topic');
    if (topic) {
      $('browse-topic').value = topic;
      browse(topic, $('browse-state').value, null);
    }
    const id = q.get('message');
    if (id) {
      $('lookup-id').value = id;
      lookedUp = id;
      showMessage(id, false);
    }
    if (lastTopics) renderTopics(lastTopics.topics, lastTopics.full);
  }

  // ---- look-up ----

  async function lookup(id) {
    $('lookup-id').value = id;
    lookedUp = id;
    saveUrl();
    await showMessage(id, false);
    $('lookup').scrollIntoView({ block: 'start' });
  }

  async function showMessage(id, quiet) {
    let m;
    try {
      m = await api('GET', 'v1/messages/' + enc(id));
    } catch (e) {
      if (e.status === 404 && e.code === 'not_found') {
        $('lookup-result').hidden = true;
        lookedUp = null;
        say('No message with id ' + id + '.', true);
        return;
      }
      if (!quiet) report(e);
      return;
    }
    const rows = [
      ['Id', h('code', null, m.id)],
      ['Topic', h('code', null, m.topic)],
      ['State', h('strong', { id: 'lookup-state' }, m.state)],
      [m.state === 'reserved' ? 'Reserved until' : 'Deliver at', when(m.deliver_at_ms)],
      ['Attempt', m.attempt],
    ];
    if (m.dead_letter_topic) rows.push(['Dead-letter topic', h('code', null, m.dead_letter_topic)]);
    if (m.created_at_ms !== undefined) rows.push(['Created', when(m.created_at_ms)]);
    if (m.last_error) {
      rows.push(['Last error', [when(m.last_error.time_ms), ' — ' + preview(m.last_error.message, BODY_FULL_CHARS)]]);
    }
    // The history is a second, cheap call (one log read per change); without it the rest shows.
    try {
      const hist = await api('GET', 'v1/messages/' + enc(id) + '/history');
      const list = historyList(hist.history);
      if (!hist.complete) list.append(h('li', null, 'earlier changes are no longer kept'));
      rows.push(['History', list]);
    } catch (_) {
      rows.push(['History', 'not available']);
    }
    rows.push(['Body', h('pre', null, preview(m.body, BODY_FULL_CHARS))]);
    $('lookup-fields').replaceChildren(...rows.flatMap(([k, v]) => [h('dt', null, k), h('dd', null, v)]));
    const cancel = $('cancel-msg');
    cancel.disabled = m.state === 'done' || m.state === 'cancelled';
    $('lookup-result').hidden = false;
  }

  // Newest first, as the API lists them: when, what happened, the state it left.
  function historyList(entries) {
    return h('ol', { class: 'history' }, ...entries.map((e) =>
      h('li', { 'data-event': e.event }, when(e.time_ms), ' — ', h('strong', null, e.event),
        ' → ' + e.state + (e.attempt ? ' (attempt ' + e.attempt + ')' : ''))));
  }

  async function cancelShown() {
    const id = lookedUp;
    if (!id || !confirm('Cancel message ' + id + '? It will not be delivered.')) return;
    try {
      await api('DELETE', 'v1/messages/' + enc(id));
      say('Message ' + id + ' cancelled.', false);
    } catch (e) {
      report(e);
    }
    await showMessage(id, true);
    refresh();
  }

  // ---- cluster ----

  let bannerKey = null; // what the banner shows, so an unchanged one is not announced again

  // A node's dashboard from its API URL (which came from a peer), as a link target only when it
  // is plain http(s): never a script URL.
  function dashboardOf(apiUrl) {
    if (typeof apiUrl !== 'string' || !apiUrl) return null;
    let u;
    try {
      u = new URL(apiUrl);
    } catch (_) {
      return null;
    }
    if (u.protocol !== 'http:' && u.protocol !== 'https:') return null;
    return u.origin + u.pathname.replace(/\/+$/, '') + '/ui';
  }

  function dashboardLink(apiUrl, text, props) {
    const href = dashboardOf(apiUrl);
    return href ? h('a', Object.assign({ href }, props), text) : text;
  }

  function known(v) {
    return v === null || v === undefined ? '—' : v;
  }

  // "3 s ago", from a node's clock: a little ahead of the browser's still reads "just now".
  function ago(ms, never) {
    if (ms === null || ms === undefined) return never;
    const d = Date.now() - ms;
    const iso = new Date(ms).toISOString();
    return h('time', { datetime: iso, title: iso }, d < 1000 ? 'just now' : fmtSpan(d) + ' ago');
  }

  // This node's /v1/cluster, or null from a delayd that has none (a single node, as before).
  async function refreshCluster() {
    let c = null;
    try {
      c = await api('GET', 'v1/cluster');
    } catch (e) {
      if (!unavailable(e)) throw e;
    }
    renderCluster(c);
    renderBanner(c);
    return c;
  }

  function renderCluster(c) {
    const nodes = (c && c.nodes) || [];
    // A cluster of one is a single node: its dashboard stays as it was.
    $('cluster').hidden = nodes.length < 2;
    if (nodes.length < 2) return;
    const leader = c.leader_id;
    const facts = [
      ['This node', c.node_id + ' (' + c.role + ')'],
      ['Term', c.term],
      ['Leader', leader ? ['node ' + leader + ' · ', c.leader_url
        ? dashboardLink(c.leader_url, c.leader_url, { id: 'cluster-leader-link' }) : 'address not known yet']
        : 'none at the moment'],
      ['Commit index', c.commit_index],
      ['Last index', c.last_index],
      ['Applied index', c.applied_index],
    ];
    $('cluster-facts').replaceChildren(...facts.map(([k, v]) =>
      h('div', null, h('dt', null, k), h('dd', { 'data-fact': k }, ...[].concat(v)))));
    const refused = $('cluster-refused');
    refused.hidden = c.may_lead !== false;
    refused.textContent = c.may_lead === false
      ? 'This node may not lead: ' + (c.not_leading_because || 'no reason given') + '.' : '';
    $('cluster-nodes').tBodies[0].replaceChildren(...nodes.map((n) => nodeRow(c, n)));
    $('cluster-hint').textContent = c.leading
      ? 'Match index and lag as this leader knows them; last contact: the last message from that node.'
      : 'Match index and lag are known to the leader only: see them on its dashboard.';
  }

  function nodeRow(c, n) {
    const self = n.node_id === c.node_id;
    // Roles as far as this node knows them: the leader is its leader_id, its own role it knows.
    const role = n.node_id === c.leader_id ? h('span', { class: 'badge leader' }, 'leader')
      : self ? c.role : c.leader_id ? 'follower' : '—';
    return h('tr', { 'data-node': n.node_id, class: self ? 'self' : null },
      h('th', { scope: 'row' }, String(n.node_id), self ? h('span', { class: 'hint' }, ' (this node)') : null),
      h('td', { 'data-label': 'API' }, n.api_url ? dashboardLink(n.api_url, n.api_url) : '—'),
      h('td', { 'data-label': 'Cluster address' }, n.cluster_addr ? h('code', null, n.cluster_addr) : '—'),
      h('td', { 'data-label': 'Role', 'data-role': true }, role),
      h('td', { class: 'num', 'data-label': 'Match index' }, known(n.match_index)),
      h('td', { class: 'num', 'data-label': 'Lag (entries)' }, known(n.lag_entries)),
      // A follower hears from the leader only, so silence from another follower means nothing.
      h('td', { 'data-label': 'Last contact' }, self ? '—' : ago(n.last_contact_ms, c.leading ? 'never' : '—')));
  }

  // On a node that does not lead: who leads, and a link to its dashboard.
  function renderBanner(c) {
    const leading = !c || c.leading !== false;
    const key = leading ? '' : JSON.stringify([c.node_id, c.role, c.leader_id, c.leader_url, !!token()]);
    if (key === bannerKey) return;
    bannerKey = key;
    $('leader-banner').hidden = leading;
    if (leading) return;
    const me = 'This node (' + c.node_id + ')';
    const href = dashboardOf(c.leader_url);
    let parts;
    if (c.leader_id === c.node_id) {
      parts = [me + ' has just been elected leader and is catching up; its figures show in a moment.'];
    } else if (c.leader_id) {
      parts = [me + ' is a ' + c.role + '; the leader is node ' + c.leader_id];
      if (c.leader_url) parts.push(' at ', h('code', null, c.leader_url));
      else parts.push(' (its address is not known yet)');
      if (href) parts.push(' — ', h('a', { href, id: 'leader-link' }, 'open its dashboard'));
      parts.push('.');
    } else {
      parts = [me + ' is a ' + c.role + '; no leader at the moment (election in progress or majority lost). ' +
        'This page names the new leader once there is one.'];
    }
    $('leader-banner-text').replaceChildren(...parts);
    $('leader-banner-token').hidden = !(href && c.leader_id !== c.node_id && token());
  }

  // Everything but the cluster panel is the leader's to answer: on another node the panels keep
  // what they showed last, greyed, and every action is disabled (by their fieldsets).
  function setLeading(on) {
    document.body.classList.toggle('not-leading', !on);
    for (const f of document.querySelectorAll('fieldset.live')) f.disabled = !on;
    for (const n of document.querySelectorAll('.by-leader')) n.hidden = on;
    // The strip and charts are the leader's figures; a follower's page points there instead.
    if (!on) {
      $('health').hidden = true;
      $('charts').hidden = true;
    }
    // Nothing shown before: an empty greyed table would say nothing, the note says it all.
    $('levels-live').hidden = !on && !lastStats;
    $('topics-live').hidden = !on && !lastStats;
    const greyed = 'Served by the leader. Greyed: what this node showed when it last led.';
    $('levels-by-leader').textContent = lastStats ? greyed : 'Served by the leader.';
    $('topics-by-leader').textContent = lastStats ? greyed : 'Served by the leader.';
  }

  // Asks the cluster again after a call found this node no longer leading; true when it does not.
  async function followerNow() {
    try {
      const c = await refreshCluster();
      const leading = !c || c.leading !== false;
      setLeading(leading);
      return !leading;
    } catch (_) {
      return false;
    }
  }

  // ---- refresh ----

  async function refresh() {
    clearTimeout(timer);
    timer = null;
    try {
      const c = await refreshCluster();
      if (c) tokenAccepted();
      const leading = !c || c.leading !== false;
      setLeading(leading);
      if (!leading) {
        // Nothing went wrong: the banner says where the data is.
        if (refreshFailed) say('', false);
        refreshFailed = false;
        return;
      }
      const stats = await api('GET', 'v1/stats');
      tokenAccepted();
      if (refreshFailed) say('', false);
      refreshFailed = false;
      renderLevels(stats);
      await refreshHistory(stats);
      await refreshTopics(stats);
      if (restorePending) {
        // Once, when the data can first be read (the token may have been asked for first).
        restorePending = false;
        restoreUrl();
      }
      if (lookedUp) await showMessage(lookedUp, true);
    } catch (e) {
      if (notLeading(e) && (await followerNow())) {
        say('', false);
        refreshFailed = false;
        return;
      }
      refreshFailed = !(e instanceof ApiError && e.status === 401);
      report(e);
    } finally {
      schedule();
    }
  }

  let restorePending = true;

  function tokenAccepted() {
    if (!needToken) return;
    needToken = false;
    $('auth').hidden = true;
  }

  function schedule() {
    clearTimeout(timer);
    timer = $('auto').checked && !needToken ? setTimeout(refresh, REFRESH_MS) : null;
  }

  $('auth-form').addEventListener('submit', useToken);
  $('forget').addEventListener('click', forgetToken);
  $('refresh').addEventListener('click', refresh);
  $('auto').addEventListener('change', schedule);
  $('idle-levels').addEventListener('change', () => {
    if (lastStats) renderLevels(lastStats);
  });
  $('browse-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const topic = $('browse-topic').value.trim();
    if (topic) browse(topic, $('browse-state').value, null);
  });
  $('more').addEventListener('click', () => {
    if (browsing && browsing.cursor) browse(browsing.topic, browsing.state, browsing.cursor);
  });
  $('lookup-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const id = $('lookup-id').value.trim();
    if (id) lookup(id);
  });
  $('cancel-msg').addEventListener('click', cancelShown);
  $('flow-form').addEventListener('submit', saveFlow);
  $('flow-clear').addEventListener('click', clearFlow);
  $('select-all').addEventListener('change', selectAll);
  $('bulk-deliver').addEventListener('click', bulkDeliver);
  $('bulk-cancel').addEventListener('click', bulkCancel);
  $('bulk-redrive').addEventListener('click', bulkRedrive);
  $('topic-filter').addEventListener('input', async () => {
    saveUrl();
    if (!lastTopics) return;
    renderTopics(lastTopics.topics, lastTopics.full);
    const missing = filtered(lastTopics.topics).filter((t) => !t.topic.endsWith('.dlq') && !pushes.has(t.topic));
    if (!missing.length) return;
    await refreshPush(filtered(lastTopics.topics).filter((t) => !t.topic.endsWith('.dlq')).slice(0, PUSH_LOOKUPS));
    renderTopics(lastTopics.topics, lastTopics.full);
  });
  window.addEventListener('hashchange', restoreUrl);
  $('topic-filter').value = new URLSearchParams(location.hash.slice(1)).get('filter') || '';
  $('forget').hidden = !token();
  refresh();
})();
