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
    parts.push('updated ' + new Date().toLocaleTimeString());
    $('summary').textContent = parts.join(' · ');
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
    renderTopics(topics, full);
  }

  function renderTopics(topics, full) {
    const names = new Set(topics.map((t) => t.topic));
    const rows = topics.map((t) => {
      const isDlq = t.topic.endsWith('.dlq');
      const base = isDlq ? t.topic.slice(0, -4) : t.topic;
      // A dead-letter topic gets the redrive and purge buttons on its own row; its base topic
      // gets them only when that row is not listed, so each pair shows once.
      const dlqActions = full && (isDlq || (t.dead_lettered > 0 && !names.has(t.topic + '.dlq')));
      const actions = h('td', { class: 'actions' },
        h('button', { type: 'button', key: 'browse:' + t.topic, 'aria-label': 'Browse ' + t.topic,
          onclick: () => startBrowse(t.topic) }, 'Browse'),
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
        h('td', { 'data-label': 'State' }, state),
        actions);
    });
    replaceKeepingFocus($('topics').tBodies[0], rows);
    $('topics-empty').hidden = rows.length > 0;
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

  async function browse(topic, state, cursor) {
    const note = $('browse-note');
    const table = $('messages');
    const q = new URLSearchParams({ state, limit: String(PAGE_SIZE) });
    if (cursor) q.set('cursor', cursor);
    let page;
    try {
      page = await api('GET', 'v1/topics/' + enc(topic) + '/messages?' + q);
    } catch (e) {
      note.hidden = false;
      table.hidden = true;
      $('more').hidden = true;
      note.textContent = unavailable(e) ? 'Not available on this server: GET /v1/topics/{topic}/messages.'
        : e.status === 401 ? 'A token is needed.' : e.message;
      return;
    }
    const tbody = table.tBodies[0];
    if (!cursor) tbody.replaceChildren();
    for (const m of page.messages || []) {
      tbody.append(h('tr', { 'data-id': m.id },
        h('td', null, h('button', { type: 'button', class: 'link mono', 'aria-label': 'Look up ' + m.id,
          onclick: () => lookup(m.id) }, m.id)),
        h('td', { 'data-label': 'State' }, m.state),
        h('td', { 'data-label': 'Deliver at' }, when(m.deliver_at_ms)),
        h('td', { class: 'num', 'data-label': 'Attempt' }, m.attempt),
        h('td', { class: 'body' }, preview(m.body, BODY_PREVIEW_CHARS))));
    }
    browsing = { topic, state, cursor: page.next_cursor || null };
    const empty = tbody.rows.length === 0;
    table.hidden = empty;
    note.hidden = !empty;
    note.textContent = empty ? 'No ' + state + ' messages in ' + topic + '.' : '';
    $('more').hidden = !browsing.cursor;
  }

  // ---- look-up ----

  async function lookup(id) {
    $('lookup-id').value = id;
    lookedUp = id;
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
      await refreshTopics(stats);
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
  $('forget').hidden = !token();
  refresh();
})();
