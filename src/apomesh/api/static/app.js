// apomesh operator console: one page, vanilla JavaScript, no build step.
//
// Pages (hash routes): #/sessions, #/sessions/<id>, #/recoverable, #/workers, #/daemons.
// Auth: when the API answers 401 the token dialog opens; the token is kept in sessionStorage
// ("apomesh.token") and sent as "Authorization: Bearer <token>" on every request, including the
// event stream, which is read with fetch() (not EventSource) so the token never appears in a URL.
// The event stream reconnects by itself with Last-Event-ID after a drop or a daemon restart.
//
// Stable hooks for browser tests (data-testid unless noted):
//   layout     nav-sessions, nav-recoverable, nav-workers, nav-daemons, recoverable-count, conn-status
//              (data-state: ok|offline|unauthorized), token-button, notice, view
//   token      token-dialog, token-input, token-submit, token-cancel, token-clear, token-error
//   sessions   sessions-page, session-filter-status (select), session-search (input: goal or id),
//              session-filter-date (input type=date: updated on or after), sessions-table,
//              session-row (data-session-id, data-status), session-link, sessions-empty, page-error
//   session    session-page (data-session-id), session-id, session-status (data-status),
//              session-goal, session-output, session-reason, session-facts, stream-state
//              (data-state: connecting|live|reconnecting|ended), session-cancel,
//              cancel-confirm-yes, cancel-confirm-no, session-resume (a recoverable session) and
//              its resume-preview (as on the recoverable page),
//              hitl-list, hitl-pause (data-pause-id), hitl-question, hitl-answer-input,
//              hitl-answer-submit, hitl-error,
//              unknown-outcomes, unknown-outcome,
//              agent-tree, agent-node (data-agent-ref, data-phase: the log's, data-shown: what
//              the badge says, "stopped" for a live agent of a recoverable session,
//              data-resuming="true|false"), agent-phase, agent-open (shows its conversation),
//              agent-resuming-badge, agent-resumes,
//              agent-timeline, agent-bar (data-agent-ref, data-phase, data-resumes),
//              agent-bar-resume, agent-timeline-span,
//              conversation-panel, conversation (data-agent-ref), conversation-entry (data-kind,
//              data-outcome), conversation-args, conversation-text,
//              timeline, timeline-filter-kind, timeline-filter-agent (selects), timeline-count,
//              timeline-item (data-kind, data-index, data-agent, data-open; class "resume" for
//              AgentResuming/AgentResumed; a click opens its payload), timeline-payload
//   recovery   recoverable-page, recoverable-search, recoverable-table, recoverable-row
//              (data-session-id), recoverable-resume, recoverable-empty, resume-preview
//              (data-session-id), preview-reason, preview-unknown-outcome, preview-no-unknown,
//              preview-pin-diff, preview-no-pins, resume-migrate-pins (checkbox), resume-confirm,
//              resume-back, resume-error
//   workers    workers-page, workers-table, worker-row (data-worker-id, data-alive),
//              worker-heartbeat, workers-empty
//   daemons    daemons-page, daemons-table, daemon-row (data-daemon-id, data-state,
//              data-this), daemon-sessions, daemon-lease-age

const TOKEN_KEY = "apomesh.token";
const STATUSES = ["running", "paused", "completed", "failed", "cancelled", "recoverable"];
const POLL_MS = 2000;
const TIMELINE_MAX = 2000;

// --- small DOM helpers ---------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "testid") node.dataset.testid = value;
    else if (key === "data") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value === true) node.setAttribute(key, "");
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function formatTime(ts) {
  if (!ts) return "—";
  return new Date(ts * 1000).toLocaleString();
}

function ago(ts) {
  if (!ts) return "never";
  const seconds = Math.max(0, Date.now() / 1000 - ts);
  if (seconds < 90) return `${Math.round(seconds)} s ago`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}

function badge(status, testid) {
  return h("span", { class: `badge status-${status}`, testid, data: { status } }, status);
}

function notice(text, kind = "info") {
  const box = $("notice");
  box.textContent = text;
  box.dataset.kind = kind;
  box.hidden = false;
  clearTimeout(notice.timer);
  notice.timer = setTimeout(() => { box.hidden = true; }, 6000);
}

function setConn(state, text) {
  const conn = $("conn-status");
  conn.dataset.state = state;
  conn.textContent = text;
}

// --- token and API calls -------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message, body) {
    super(message || code || `HTTP ${status}`);
    this.status = status;
    this.code = code;
    this.body = body;
  }
}

const getToken = () => sessionStorage.getItem(TOKEN_KEY) || "";
let tokenWaiters = null;

function askToken(reason) {
  // One dialog for every request that got a 401 meanwhile; all of them retry once it closes.
  if (tokenWaiters) return tokenWaiters.promise;
  let resolve, reject;
  const promise = new Promise((ok, fail) => { resolve = ok; reject = fail; });
  tokenWaiters = { promise, resolve, reject };
  $("token-error").textContent = reason || "";
  $("token-input").value = "";
  const dialog = $("token-dialog");
  if (!dialog.open) dialog.showModal();
  $("token-input").focus();
  return promise;
}

function closeTokenDialog(accepted) {
  const dialog = $("token-dialog");
  if (dialog.open) dialog.close();
  const waiters = tokenWaiters;
  tokenWaiters = null;
  if (!waiters) return;
  if (accepted) waiters.resolve();
  else waiters.reject(new ApiError(401, "unauthorized", "a token is needed"));
}

function setupTokenDialog() {
  const submit = () => {
    const value = $("token-input").value.trim();
    if (!value) { $("token-error").textContent = "Enter a token."; return; }
    sessionStorage.setItem(TOKEN_KEY, value);
    closeTokenDialog(true);
  };
  $("token-submit").addEventListener("click", submit);
  $("token-input").addEventListener("keydown", (e) => { if (e.key === "Enter") submit(); });
  $("token-cancel").addEventListener("click", () => closeTokenDialog(false));
  $("token-clear").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    $("token-error").textContent = "Token forgotten.";
  });
  $("token-dialog").addEventListener("cancel", (e) => { e.preventDefault(); closeTokenDialog(false); });
  $("token-button").addEventListener("click", () => askToken("").then(() => render()).catch(() => {}));
}

function headers(extra = {}) {
  const all = { Accept: "application/json", ...extra };
  const token = getToken();
  if (token) all.Authorization = `Bearer ${token}`;
  return all;
}

async function api(method, path, body) {
  for (let attempt = 0; attempt < 4; attempt += 1) {
    let response;
    try {
      response = await fetch(path, {
        method,
        headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }),
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: "no-store",
      });
    } catch (error) {
      setConn("offline", "daemon unreachable");
      throw new ApiError(0, "unavailable", "the daemon cannot be reached");
    }
    if (response.status === 401) {
      setConn("unauthorized", "token needed");
      await askToken(getToken() ? "That token was not accepted." : "");
      continue;
    }
    setConn("ok", "connected");
    const data = response.status === 204 ? null : await response.json().catch(() => null);
    if (!response.ok) {
      throw new ApiError(response.status, data && data.error, data && data.message, data);
    }
    return data;
  }
  throw new ApiError(401, "unauthorized", "no accepted token");
}

// Read a session's server-sent events with fetch, resuming after the last index seen.
async function followEvents(sessionId, after, { onEvent, onState, signal }) {
  let last = after;
  let delay = 250;
  const path = `/v1/sessions/${encodeURIComponent(sessionId)}/events`;
  while (!signal.aborted) {
    try {
      const extra = { Accept: "text/event-stream" };
      if (last >= 0) extra["Last-Event-ID"] = String(last);
      const response = await fetch(path, { headers: headers(extra), signal, cache: "no-store" });
      if (response.status === 401) {
        onState("reconnecting");
        await askToken(getToken() ? "That token was not accepted." : "");
        continue;
      }
      if (response.status === 404) { onState("ended"); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      onState("live");
      setConn("ok", "connected");
      delay = 250;
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer = (buffer + value).replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          const data = block.split("\n")
            .filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, ""))
            .join("\n");
          if (!data) continue;  // a keep-alive comment
          const envelope = JSON.parse(data);
          if (envelope.index <= last) continue;
          last = envelope.index;
          onEvent(envelope);
          if (envelope.kind === "SessionEnded") { onState("ended"); return; }
        }
      }
    } catch (error) {
      if (signal.aborted) return;
      if (error && error.status === 401) { onState("ended"); return; }
    }
    if (signal.aborted) return;
    onState("reconnecting");
    await sleep(delay);
    delay = Math.min(delay * 2, 5000);
  }
}

// --- pages ---------------------------------------------------------------------------------

let page = null;  // { cleanup: [fn] } of the page on screen

function leavePage() {
  if (!page) return;
  for (const fn of page.cleanup) { try { fn(); } catch (_) { /* already gone */ } }
  page = null;
}

function startPage() {
  leavePage();
  page = { cleanup: [] };
  return page;
}

function every(current, ms, fn) {
  const timer = setInterval(() => { if (page === current) fn(); }, ms);
  current.cleanup.push(() => clearInterval(timer));
}

function showError(container, error) {
  container.replaceChildren(h("p", { class: "error", testid: "page-error" },
    error instanceof ApiError && error.message ? error.message : String(error)));
}

// Sessions list ----------------------------------------------------------------------------

const listFilter = { status: "", query: "", since: "" };

// The start of a local calendar day ("2026-12-02") in unix seconds, or 0 for none.
function dayStart(date) {
  if (!date) return 0;
  const [y, m, d] = date.split("-").map(Number);
  return new Date(y, m - 1, d).getTime() / 1000;
}

function renderSessions() {
  const current = startPage();
  const status = h("select", { id: "session-filter-status", testid: "session-filter-status",
    "aria-label": "Filter by status" },
    h("option", { value: "" }, "all statuses"),
    STATUSES.map((s) => h("option", { value: s, selected: s === listFilter.status }, s)));
  const search = h("input", { id: "session-search", testid: "session-search", type: "search",
    placeholder: "Search goal or id", value: listFilter.query, "aria-label": "Search sessions" });
  const since = h("input", { id: "session-filter-date", testid: "session-filter-date", type: "date",
    value: listFilter.since, "aria-label": "Updated on or after" });
  const body = h("tbody");
  const table = h("table", { id: "sessions-table", testid: "sessions-table", class: "grid" },
    h("thead", {}, h("tr", {}, ["Session", "Status", "Goal", "Events", "Side effects", "Updated"]
      .map((t) => h("th", {}, t)))), body);
  const empty = h("p", { testid: "sessions-empty", class: "empty", hidden: true }, "No sessions match.");
  const errors = h("div");
  $("view").replaceChildren(h("section", { id: "sessions-page", testid: "sessions-page" },
    h("h1", {}, "Sessions"),
    h("div", { class: "toolbar" }, status, search,
      h("label", { class: "inline", for: "session-filter-date" }, "updated since"), since),
    errors, table, empty));

  async function load() {
    const params = new URLSearchParams({ limit: "200" });
    if (listFilter.status) params.set("status", listFilter.status);
    if (listFilter.query) params.set("q", listFilter.query);
    try {
      const data = await api("GET", `/v1/sessions?${params}`);
      if (page !== current) return;
      errors.replaceChildren();
      const from = dayStart(listFilter.since);
      const shown = data.sessions.filter((s) => s.updated_at >= from);
      body.replaceChildren(...shown.map((s) => h("tr",
        { testid: "session-row", data: { sessionId: s.session_id, status: s.status } },
        h("td", {}, h("a", { href: `#/sessions/${encodeURIComponent(s.session_id)}`,
          testid: "session-link", class: "mono" }, s.session_id)),
        h("td", {}, badge(s.status)),
        h("td", { class: "goal" }, s.goal),
        h("td", { class: "num" }, s.last_index + 1),
        h("td", { class: "num" }, s.side_effects),
        h("td", {}, formatTime(s.updated_at)))));
      empty.hidden = shown.length > 0;
    } catch (error) {
      if (page === current) showError(errors, error);
    }
  }
  status.addEventListener("change", () => { listFilter.status = status.value; load(); });
  since.addEventListener("change", () => { listFilter.since = since.value; load(); });
  let debounce = null;
  search.addEventListener("input", () => {
    clearTimeout(debounce);
    debounce = setTimeout(() => { listFilter.query = search.value.trim(); load(); }, 250);
  });
  current.cleanup.push(() => clearTimeout(debounce));
  load();
  every(current, POLL_MS, load);
}

// One session ------------------------------------------------------------------------------

function describe(env) {
  const e = env.event || {};
  switch (env.kind) {
    case "SessionStarted": return `started: ${e.goal}`;
    case "AgentLifecycle": {
      let text = `${e.agent} → ${e.phase}`;
      if (e.phase === "born" && e.task) text += `: ${e.task}`;
      if (e.worker && e.phase === "dispatched") text += ` on ${e.worker}`;
      if (e.reason) text += ` (${e.reason})`;
      return text;
    }
    case "AgentResuming": return `${e.agent} resuming (${e.reason}), epoch ${e.epoch}`;
    case "AgentResumed": return `${e.agent} resumed, epoch ${e.epoch}`;
    case "HitlPaused": return `${e.agent} asks: ${e.question}`;
    case "HitlAnswered": return `pause ${e.pause_id} answered by ${e.by}`;
    case "ToolCallIntent": return `${e.agent} calls ${e.tool}`;
    case "ToolCallRecorded": return `${e.agent} ${e.tool}: ${e.outcome}`;
    case "AsyncJobStarted": return `${e.agent} started job ${e.job_id} (${e.tool})`;
    case "AsyncJobFinished": return `job ${e.job_id} ${e.ok ? "finished" : "failed"}`;
    case "CoordinatorCheckpoint": return `checkpoint at ${e.position}`;
    case "AgentSnapshotted": return `${e.agent} snapshot (${e.source}, step ${e.step})`;
    case "SessionRecovered": return `session recovered (${e.path})`;
    case "OperatorAction": return `operator ${e.action} by ${e.by}`;
    case "SessionEnded": return `session ${e.status}${e.reason ? `: ${e.reason}` : ""}`;
    default: return env.kind;
  }
}

const TERMINAL_PHASES = ["completed", "failed", "cancelled"];
const REASON_PHASES = ["paused", "waiting", "failed", "cancelled"];

// The phase an agent is shown with: the log's, except that nothing runs in a session waiting on
// the recoverable list (its agents are "stopped" until an operator resumes it).
function shownPhase(agent, sessionStatus) {
  if (sessionStatus === "recoverable" && !TERMINAL_PHASES.includes(agent.phase)) return "stopped";
  return agent.phase;
}

function agentTree(agents, sessionStatus, onOpen) {
  const children = new Map();
  for (const agent of agents) {
    const key = agent.parent || "";
    if (!children.has(key)) children.set(key, []);
    children.get(key).push(agent);
  }
  const known = new Set(agents.map((a) => a.ref));
  const roots = agents.filter((a) => !a.parent || !known.has(a.parent));
  const node = (agent) => {
    const kids = children.get(agent.ref) || [];
    const phase = shownPhase(agent, sessionStatus);
    const stopped = phase === "stopped";
    const resuming = agent.resuming && !stopped;
    return h("li", { testid: "agent-node", class: resuming ? "agent resuming" : "agent",
      data: { agentRef: agent.ref, phase: agent.phase, shown: phase, resuming: String(resuming) } },
      h("div", { class: "agent-line" },
        h("span", { class: `badge phase-${phase}`, testid: "agent-phase",
          title: stopped ? `${agent.phase} when the session stopped; it runs again once resumed` : null }, phase),
        h("button", { type: "button", class: "link agent-name", testid: "agent-open",
          title: "Show this agent's conversation", onclick: () => onOpen(agent.ref) }, agent.name),
        h("code", { class: "agent-ref" }, agent.ref),
        resuming ? h("span", { class: "badge resuming", testid: "agent-resuming-badge" }, "resuming") : null,
        agent.resumes ? h("span", { class: "resumes", testid: "agent-resumes",
          title: "times this agent was resumed" }, `resumes: ${agent.resumes}`) : null),
      agent.worker ? h("div", { class: "agent-meta" },
        `${stopped || TERMINAL_PHASES.includes(agent.phase) ? "was on" : "on"} ${agent.worker} · epoch ${agent.epoch}`) : null,
      agent.task ? h("div", { class: "agent-task" }, h("span", { class: "label" }, "task"), agent.task) : null,
      agent.output && agent.phase === "completed"
        ? h("div", { class: "agent-output" }, h("span", { class: "label" }, "output"), agent.output) : null,
      agent.reason && REASON_PHASES.includes(agent.phase) ? h("div", { class: `agent-reason reason-${agent.phase}` },
        h("span", { class: "label" }, "why"), agent.reason) : null,
      kids.length ? h("ul", {}, kids.map(node)) : null);
  };
  return roots.map(node);
}

// What the log says of each agent over time, for the agent timeline: its phases with their start
// times, when it was resumed and why, and when it ended.
class AgentSpans {
  constructor() { this.agents = new Map(); this.start = 0; this.last = 0; this.ended = 0; this.outages = []; this.resumedFrom = 0; }

  add(env) {
    const e = env.event || {};
    if (!this.start) this.start = env.ts;
    // A recovered session was stopped from its last event before the operator resumed it (or
    // the daemon recovered it) until its recovery.
    if (env.kind === "OperatorAction" && e.action === "resume" && !this.resumedFrom) this.resumedFrom = this.last;
    if (env.kind === "SessionRecovered" && this.last) {
      this.outages.push({ from: this.resumedFrom || this.last, to: env.ts });
      this.resumedFrom = 0;
    }
    this.last = Math.max(this.last, env.ts);
    if (env.kind === "SessionEnded") this.ended = env.ts;
    if (env.kind === "AgentLifecycle") {
      if (e.phase === "born") {
        this.agents.set(e.agent, { ref: e.agent, phases: [], resumes: [], end: 0 });
      }
      const span = this.agents.get(e.agent);
      if (!span) return;
      span.phases.push({ phase: e.phase, from: env.ts });
      span.end = TERMINAL_PHASES.includes(e.phase) ? env.ts : 0;
    } else if (env.kind === "AgentResuming") {
      const span = this.agents.get(e.agent);
      if (span) span.resumes.push({ at: env.ts, reason: e.reason, epoch: e.epoch });
    }
  }
}

function formatSeconds(seconds) {
  if (seconds < 90) return `${seconds.toFixed(1)} s`;
  if (seconds < 5400) return `${(seconds / 60).toFixed(1)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function agentTimeline(spans, sessionStatus, live) {
  if (!spans.agents.size) return [h("p", { class: "muted" }, "No agent yet.")];
  const t0 = spans.start;
  const t1 = Math.max(spans.ended || (live ? Date.now() / 1000 : spans.last), t0 + 0.001);
  const pos = (t) => `${(100 * (Math.min(Math.max(t, t0), t1) - t0) / (t1 - t0)).toFixed(3)}%`;
  const rows = [...spans.agents.values()].map((span) => {
    const track = h("div", { class: "track" });
    const segment = (phase, from, until, title) => {
      const seg = h("div", { class: `seg phase-${phase}`, title, data: { from: String(from), until: String(until) } });
      seg.style.left = pos(from);
      seg.style.width = `calc(${pos(Math.max(until, from))} - ${pos(from)})`;
      seg.style.minWidth = "2px";
      track.append(seg);
    };
    // An agent still open when its session stopped (on the recoverable list) is shown in its
    // last phase up to the session's last event, then "stopped".
    const stoppedAt = !span.end && sessionStatus === "recoverable" ? spans.last : 0;
    span.phases.forEach((p, i) => {
      const lastPhase = i + 1 === span.phases.length;
      const until = lastPhase ? (span.end || stoppedAt || t1) : span.phases[i + 1].from;
      if (until <= p.from && !lastPhase) return;
      segment(p.phase, p.from, until, `${p.phase} from ${formatTime(p.from)}`);
    });
    if (stoppedAt) segment("stopped", stoppedAt, t1, `stopped since ${formatTime(stoppedAt)}`);
    const born = span.phases.length ? span.phases[0].from : t1;
    for (const outage of spans.outages) {
      if (born <= outage.from && (!span.end || span.end > outage.from)) {
        segment("stopped", outage.from, outage.to, `stopped from ${formatTime(outage.from)} until recovered`);
      }
    }
    for (const r of span.resumes) {
      const mark = h("div", { class: "resume-mark", testid: "agent-bar-resume",
        title: `resumed at ${formatTime(r.at)}: ${r.reason} (epoch ${r.epoch})` });
      mark.style.left = pos(r.at);
      track.append(mark);
    }
    const last = span.phases.length ? span.phases[span.phases.length - 1].phase : "born";
    return h("div", { class: "bar-row", testid: "agent-bar",
      data: { agentRef: span.ref, phase: last, resumes: String(span.resumes.length) } },
      h("code", { class: "bar-label", title: span.ref }, span.ref), track);
  });
  return [
    h("div", { class: "bars" }, rows),
    h("div", { class: "axis muted" }, h("span", {}, new Date(t0 * 1000).toLocaleTimeString()),
      h("span", { testid: "agent-timeline-span" }, formatSeconds(t1 - t0)),
      h("span", {}, new Date(t1 * 1000).toLocaleTimeString())),
    h("div", { class: "legend muted" }, ["dispatched", "running", "planned", "paused", "waiting", "completed",
      "failed", "stopped"].map((p) => h("span", {}, h("i", { class: `swatch phase-${p}` }), p)),
      h("span", {}, h("i", { class: "swatch resume-swatch" }), "resumed")),
  ];
}

const ENTRY_LABELS = {
  prompt: "prompt", model: "model", tool_call: "tool call", tool_result: "result",
  question: "asks a human", answer: "answer", unknown_outcome: "outcome unknown",
  plan: "plan", output: "output", ended: "ended",
};

function conversationEntry(entry) {
  const where = entry.index >= 0 && entry.index !== undefined
    ? h("span", { class: "muted where" }, `#${entry.index} · ${new Date(entry.at * 1000).toLocaleTimeString()}`) : null;
  let label = ENTRY_LABELS[entry.kind] || entry.kind;
  if (entry.kind === "tool_result") label += ` · ${entry.outcome}`;
  if (entry.kind === "answer" && entry.by) label += ` by ${entry.by}`;
  if (entry.kind === "ended") label += ` · ${entry.outcome}`;
  const body = [];
  if (entry.tool) body.push(h("code", { class: "tool" }, entry.tool));
  if (entry.args) body.push(h("pre", { class: "args", testid: "conversation-args" }, JSON.stringify(entry.args, null, 2)));
  if (entry.text) body.push(h("pre", { class: "text", testid: "conversation-text" }, entry.text));
  if (entry.key) body.push(h("div", { class: "muted key" }, "key ", h("code", {}, entry.key)));
  return h("li", { testid: "conversation-entry", class: `entry entry-${entry.kind} outcome-${entry.outcome || "none"}`,
    data: { kind: entry.kind, outcome: entry.outcome || "" } },
    h("div", { class: "entry-head" }, h("span", { class: "entry-kind" }, label), where), body);
}

// The preview an operator sees before resuming a recoverable session, and its confirm button.
function resumePreview(container, sessionId, data, onResumed) {
  const migrate = h("input", { type: "checkbox", id: "resume-migrate-pins", testid: "resume-migrate-pins" });
  const error = h("p", { class: "error", testid: "resume-error" });
  const confirm = h("button", { type: "button", class: "danger", testid: "resume-confirm" }, "Resume session");
  const pins = data.pin_diff || [];
  confirm.addEventListener("click", async () => {
    const migrate_pins = {};
    if (migrate.checked) {
      for (const diff of pins) if (diff.new) migrate_pins[diff.name] = diff.new;
    }
    confirm.disabled = true;
    try {
      await api("POST", `/v1/sessions/${encodeURIComponent(sessionId)}/resume`,
        { migrate_pins, confirm: true });
      notice(`Resume of ${sessionId} accepted.`);
      onResumed();
    } catch (err) {
      error.textContent = err.message;
      confirm.disabled = false;
    }
  });
  container.dataset.sessionId = sessionId;
  container.replaceChildren(
    h("h2", {}, "Resume ", h("code", {}, sessionId), "?"),
    h("p", { testid: "preview-reason" }, `Stranded because: ${data.reason}`),
    h("h3", {}, "Side effects with unknown outcome"),
    data.unknown_outcomes.length
      ? h("ul", { class: "unknown" }, data.unknown_outcomes.map((u) => h("li", { testid: "preview-unknown-outcome" },
        h("code", {}, u.tool), ` by ${u.agent} `, h("code", { class: "args" }, JSON.stringify(u.args)),
        h("span", { class: "muted" }, " key "), h("code", { class: "muted" }, u.key))))
      : h("p", { testid: "preview-no-unknown", class: "muted" }, "None: no side effect is in doubt."),
    h("p", { class: "muted" }, "A side effect in doubt is never re-run silently: its tool's " +
      "policy decides (fail, hold for an operator, or re-run when idempotent)."),
    h("h3", {}, "Plugin pin differences"),
    pins.length
      ? h("div", {},
        h("table", { class: "grid" }, h("thead", {}, h("tr", {}, h("th", {}, "Plugin"),
          h("th", {}, "Pinned"), h("th", {}, "Installed"))),
        h("tbody", {}, pins.map((p) => h("tr", { testid: "preview-pin-diff", data: { plugin: p.name } },
          h("td", {}, p.name), h("td", {}, p.old), h("td", {}, p.new || "not installed"))))),
        h("label", { class: "check" }, migrate, " Migrate these pins to the installed versions"))
      : h("p", { testid: "preview-no-pins", class: "muted" }, "None: every pinned plugin is installed as pinned."),
    h("div", { class: "buttons" },
      h("button", { type: "button", class: "quiet", testid: "resume-back",
        onclick: () => { container.hidden = true; } }, "Back"), " ", confirm),
    error);
  container.hidden = false;
  container.scrollIntoView({ block: "nearest" });
}

function renderSession(sessionId) {
  const current = startPage();
  const controller = new AbortController();
  current.cleanup.push(() => controller.abort());

  const status = h("span", { id: "session-status", testid: "session-status" });
  const streamState = h("span", { id: "stream-state", testid: "stream-state", class: "stream",
    data: { state: "connecting" } }, "connecting");
  const goal = h("p", { id: "session-goal", testid: "session-goal", class: "goal-text" });
  const facts = h("dl", { id: "session-facts", testid: "session-facts", class: "facts" });
  const output = h("pre", { id: "session-output", testid: "session-output", class: "output", hidden: true });
  const outputLabel = h("h2", { class: "output-label", hidden: true }, "Output");
  const reason = h("p", { id: "session-reason", testid: "session-reason", class: "reason", hidden: true });
  const actions = h("div", { class: "actions" });
  const preview = h("section", { testid: "resume-preview", class: "preview", hidden: true });
  const hitl = h("div", { id: "hitl-list", testid: "hitl-list", class: "hitl-list" });
  const unknown = h("div", { id: "unknown-outcomes", testid: "unknown-outcomes" });
  const tree = h("ul", { id: "agent-tree", testid: "agent-tree", class: "tree" });
  const bars = h("div", { id: "agent-timeline", testid: "agent-timeline", class: "agent-timeline" });
  const talkTitle = h("h2", {}, "Conversation");
  const talk = h("div", { id: "conversation", testid: "conversation", class: "conversation" },
    h("p", { class: "muted" }, "Pick an agent in the tree to read what it was asked, what the " +
      "model said, the tools it called and what they answered."));
  const kindFilter = h("select", { testid: "timeline-filter-kind", "aria-label": "Filter events by kind" },
    h("option", { value: "" }, "all kinds"));
  const agentFilter = h("select", { testid: "timeline-filter-agent", "aria-label": "Filter events by agent" },
    h("option", { value: "" }, "all agents"));
  const shownCount = h("span", { class: "muted", testid: "timeline-count" });
  const timeline = h("ol", { id: "timeline", testid: "timeline", class: "timeline" });
  const errors = h("div");

  $("view").replaceChildren(h("section", { id: "session-page", testid: "session-page",
    data: { sessionId } },
    h("a", { href: "#/sessions", class: "back" }, "← Sessions"),
    h("h1", {}, "Session ", h("code", { id: "session-id", testid: "session-id" }, sessionId), " ",
      status, " ", streamState),
    errors, goal, reason, outputLabel, output, facts, actions, preview, hitl, unknown,
    h("div", { class: "columns" },
      h("section", { class: "panel" }, h("h2", {}, "Agents"), tree),
      h("section", { class: "panel" }, h("h2", {}, "Agent timeline"), bars)),
    h("div", { class: "columns" },
      h("section", { class: "panel", testid: "conversation-panel" }, talkTitle, talk),
      h("section", { class: "panel" }, h("h2", {}, "Timeline"),
        h("div", { class: "toolbar" }, kindFilter, agentFilter, shownCount), timeline))));

  let view = null;
  let confirming = false;
  let openAgent = null;
  let talkStale = false;  // an event of the open agent arrived since its conversation was read
  const spans = new AgentSpans();
  const pauseAgents = new Map();  // pause id -> the agent that asked
  const kinds = new Set();
  const agentsSeen = new Set();
  const live = () => view && !["completed", "failed", "cancelled"].includes(view.status);

  function renderActions() {
    if (!live()) { actions.replaceChildren(); preview.hidden = true; return; }
    const buttons = [];
    if (view.status === "recoverable") {
      buttons.push(h("button", { type: "button", testid: "session-resume", onclick: showPreview },
        "Resume…"), " ");
    } else {
      preview.hidden = true;
    }
    if (confirming) {
      actions.replaceChildren(h("span", { class: "confirm" }, "Cancel this session for good? ",
        h("button", { type: "button", class: "danger", testid: "cancel-confirm-yes", onclick: async () => {
          confirming = false;
          try {
            await api("POST", `/v1/sessions/${encodeURIComponent(sessionId)}/cancel`, {});
            notice("Cancel requested.");
          } catch (error) { notice(error.message, "error"); }
          refresh();
        } }, "Yes, cancel it"),
        " ",
        h("button", { type: "button", class: "quiet", testid: "cancel-confirm-no",
          onclick: () => { confirming = false; renderActions(); } }, "No")));
      return;
    }
    buttons.push(h("button", { type: "button", class: "danger-outline", testid: "session-cancel",
      onclick: () => { confirming = true; renderActions(); } }, "Cancel session…"));
    actions.replaceChildren(...buttons);
  }

  async function showPreview() {
    let data;
    try {
      data = await api("GET", `/v1/recoverable/${encodeURIComponent(sessionId)}`);
    } catch (error) {
      notice(error.message, "error");
      return;
    }
    if (page !== current) return;
    resumePreview(preview, sessionId, data, () => { preview.hidden = true; refresh(); });
  }

  async function loadConversation() {
    if (!openAgent) return;
    const ref = openAgent;
    try {
      const data = await api("GET",
        `/v1/sessions/${encodeURIComponent(sessionId)}/agents/${ref.split("/").map(encodeURIComponent).join("/")}`);
      if (page !== current || openAgent !== ref) return;
      talkTitle.replaceChildren("Conversation of ", h("code", {}, ref));
      talk.dataset.agentRef = ref;
      talk.replaceChildren(...[
        data.instructions ? h("details", { class: "instructions" }, h("summary", {}, "instructions"),
          h("pre", {}, data.instructions)) : null,
        data.entries.length
          ? h("ol", { class: "entries" }, data.entries.map(conversationEntry))
          : h("p", { class: "muted" }, "Nothing recorded yet."),
      ].filter(Boolean));
    } catch (error) {
      if (page === current) showError(talk, error);
    }
  }

  function openConversation(ref) {
    openAgent = ref;
    loadConversation();
  }

  function renderHitl() {
    // Keep the forms of pauses still open so an answer being typed survives refreshes.
    const open = new Map(view.hitl_pending.map((p) => [p.pause_id, p]));
    for (const box of [...hitl.children]) {
      if (!open.has(box.dataset.pauseId)) box.remove();
    }
    const shown = new Set([...hitl.children].map((box) => box.dataset.pauseId));
    for (const pause of view.hitl_pending) {
      if (shown.has(pause.pause_id)) continue;
      const input = h("textarea", { testid: "hitl-answer-input", rows: 3, "aria-label": "Answer" });
      const error = h("p", { class: "error", testid: "hitl-error" });
      const submit = h("button", { type: "button", testid: "hitl-answer-submit" }, "Send answer");
      submit.addEventListener("click", async () => {
        if (!input.value.trim()) { error.textContent = "Write an answer first."; return; }
        submit.disabled = true;
        try {
          await api("POST", `/v1/sessions/${encodeURIComponent(sessionId)}/hitl/${encodeURIComponent(pause.pause_id)}`,
            { answer: input.value });
          notice("Answer sent.");
          box.classList.add("answered");
          refresh();
        } catch (err) {
          error.textContent = err.message;
          submit.disabled = false;
        }
      });
      const box = h("div", { class: "pause", testid: "hitl-pause", data: { pauseId: pause.pause_id } },
        h("p", { class: "pause-who" }, `Agent ${pause.agent} asks:`),
        h("p", { class: "pause-question", testid: "hitl-question" }, pause.question),
        input, h("div", { class: "buttons" }, submit), error);
      hitl.append(box);
    }
    hitl.hidden = view.hitl_pending.length === 0;
  }

  function renderBars() {
    if (view) bars.replaceChildren(...agentTimeline(spans, view.status, live()));
  }

  function renderView() {
    status.replaceChildren(badge(view.status));
    status.dataset.status = view.status;
    goal.textContent = view.goal;
    output.hidden = view.output === null || view.output === undefined;
    outputLabel.hidden = output.hidden;
    output.textContent = view.output || "";
    reason.hidden = !view.reason;
    reason.textContent = view.reason ? `Reason: ${view.reason}` : "";
    const fact = (k, v) => h("div", { class: "fact" }, h("dt", {}, k), h("dd", {}, v));
    facts.replaceChildren(
      fact("Coordination", view.coordination || "—"),
      fact("Events", String(view.last_index + 1)),
      fact("Side effects", String(view.side_effects)),
      fact("Agent resumes", String(view.resumes)),
      fact("Recoveries", String(view.recoveries)),
      fact("Started", formatTime(view.started_at)),
      fact("Updated", formatTime(view.updated_at)));
    tree.replaceChildren(...agentTree(view.agents, view.status, openConversation));
    unknown.replaceChildren(...(view.unknown_outcomes.length ? [
      h("h2", {}, "Side effects with unknown outcome"),
      h("ul", { class: "unknown" }, view.unknown_outcomes.map((u) => h("li", { testid: "unknown-outcome" },
        h("code", {}, u.tool), ` by ${u.agent} `, h("code", { class: "args" }, JSON.stringify(u.args))))),
    ] : []));
    renderHitl();
    renderActions();
    renderBars();
    if (talkStale) { talkStale = false; loadConversation(); }
  }

  let refreshing = false;
  let again = false;
  async function refresh() {
    if (refreshing) { again = true; return; }
    refreshing = true;
    try {
      do {
        again = false;
        const fresh = await api("GET", `/v1/sessions/${encodeURIComponent(sessionId)}`);
        if (page !== current) return;
        // Onto or off the recoverable list: the count in the header follows at once.
        if (view && (view.status === "recoverable") !== (fresh.status === "recoverable")) pollRecoverableCount();
        view = fresh;
        errors.replaceChildren();
        renderView();
      } while (again);
    } catch (error) {
      if (page === current) showError(errors, error);
    } finally {
      refreshing = false;
    }
  }

  let pending = null;
  function refreshSoon() {
    if (pending) return;
    pending = setTimeout(() => { pending = null; refresh(); }, 120);
  }
  current.cleanup.push(() => clearTimeout(pending));

  function matches(item) {
    return (!kindFilter.value || item.dataset.kind === kindFilter.value)
      && (!agentFilter.value || item.dataset.agent === agentFilter.value);
  }

  function applyFilter() {
    let shown = 0;
    for (const item of timeline.children) {
      item.hidden = !matches(item);
      if (!item.hidden) shown += 1;
    }
    shownCount.textContent = kindFilter.value || agentFilter.value
      ? `${shown} of ${timeline.children.length} events` : `${timeline.children.length} events`;
  }
  kindFilter.addEventListener("change", applyFilter);
  agentFilter.addEventListener("change", applyFilter);

  function addOption(select, seen, value) {
    if (!value || seen.has(value)) return;
    seen.add(value);
    select.append(h("option", { value }, value));
  }

  function addEvent(env) {
    const e = env.event || {};
    if (env.kind === "HitlPaused") pauseAgents.set(e.pause_id, e.agent);
    const agent = e.agent || (env.kind === "HitlAnswered" ? pauseAgents.get(e.pause_id) : "") || "";
    spans.add(env);
    if (openAgent && agent === openAgent) talkStale = true;
    addOption(kindFilter, kinds, env.kind);
    addOption(agentFilter, agentsSeen, agent);
    const resume = env.kind === "AgentResuming" || env.kind === "AgentResumed";
    // Follow the newest event, unless the operator scrolled up to read older ones.
    const following = timeline.scrollTop + timeline.clientHeight >= timeline.scrollHeight - 24;
    const item = h("li", { testid: "timeline-item", class: resume ? "resume" : "", tabindex: 0,
      role: "button", "aria-expanded": "false", title: "Show this event's payload",
      data: { kind: env.kind, index: String(env.index), agent } },
      h("span", { class: "idx" }, `#${env.index}`),
      h("time", {}, new Date(env.ts * 1000).toLocaleTimeString()),
      h("span", { class: `kind kind-${env.kind}` }, env.kind),
      h("span", { class: "what" }, describe(env)));
    const toggle = () => {
      const shown = item.querySelector(".payload");
      if (shown) { shown.remove(); item.setAttribute("aria-expanded", "false"); item.dataset.open = "false"; return; }
      item.append(h("pre", { class: "payload", testid: "timeline-payload" },
        JSON.stringify({ index: env.index, ts: env.ts, time: new Date(env.ts * 1000).toISOString(),
          event_id: env.event_id, kind: env.kind, event: env.event }, null, 2)));
      item.setAttribute("aria-expanded", "true");
      item.dataset.open = "true";
    };
    item.addEventListener("click", (ev) => {
      if (ev.target.closest(".payload")) return;  // selecting text in the payload keeps it open
      toggle();
    });
    item.addEventListener("keydown", (ev) => { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); toggle(); } });
    item.hidden = !matches(item);
    timeline.append(item);
    while (timeline.children.length > TIMELINE_MAX) timeline.firstElementChild.remove();
    applyFilter();
    if (following) timeline.scrollTop = timeline.scrollHeight;
    refreshSoon();
  }

  function setStream(state) {
    const was = streamState.dataset.state;
    streamState.dataset.state = state;
    streamState.textContent = state;
    // Back after a drop (a daemon restart, say): the status may have changed with no event,
    // e.g. the session now waits on the recoverable list.
    if (state === "live" && was === "reconnecting") refreshSoon();
  }
  // A session's status can change without an event (stranded on the recoverable list, resumed
  // by another operator): look again now and then while it has not ended.
  every(current, POLL_MS * 2, () => { if (live()) refreshSoon(); });
  // The bars of running agents grow with the clock.
  every(current, 1000, () => { if (live() && view.status !== "recoverable") renderBars(); });

  refresh().then(() => {
    if (page !== current) return;
    followEvents(sessionId, -1, { onEvent: addEvent, onState: setStream, signal: controller.signal })
      .then(() => { if (page === current) refresh(); });
  });
}

// Recoverable sessions ---------------------------------------------------------------------

const recoverableFilter = { query: "" };

function renderRecoverable() {
  const current = startPage();
  const body = h("tbody");
  const empty = h("p", { testid: "recoverable-empty", class: "empty", hidden: true },
    "No session is waiting for an operator.");
  const search = h("input", { testid: "recoverable-search", type: "search", value: recoverableFilter.query,
    placeholder: "Search goal, id, reason or category", "aria-label": "Search recoverable sessions" });
  const preview = h("section", { id: "resume-preview", testid: "resume-preview", class: "preview", hidden: true });
  const errors = h("div");
  $("view").replaceChildren(h("section", { id: "recoverable-page", testid: "recoverable-page" },
    h("h1", {}, "Recoverable sessions"),
    h("p", { class: "muted" }, "Sessions the daemon would not resume on its own. Check what " +
      "resuming faces before you confirm."),
    h("div", { class: "toolbar" }, search),
    errors,
    h("table", { id: "recoverable-table", testid: "recoverable-table", class: "grid" },
      h("thead", {}, h("tr", {}, ["Session", "Goal", "Reason", "Category", "Side effects",
        "Last event", ""].map((t) => h("th", {}, t)))), body),
    empty, preview));

  async function load() {
    try {
      const data = await api("GET", "/v1/recoverable");
      if (page !== current) return;
      errors.replaceChildren();
      const words = recoverableFilter.query.toLowerCase();
      const shown = data.sessions.filter((r) => !words || [r.session_id, r.goal, r.reason, r.category]
        .some((text) => (text || "").toLowerCase().includes(words)));
      body.replaceChildren(...shown.map((r) => h("tr",
        { testid: "recoverable-row", data: { sessionId: r.session_id } },
        h("td", {}, h("a", { href: `#/sessions/${encodeURIComponent(r.session_id)}`, class: "mono" },
          r.session_id)),
        h("td", { class: "goal" }, r.goal),
        h("td", {}, r.reason),
        h("td", {}, r.category || "—"),
        h("td", { class: "num" }, r.side_effects),
        h("td", {}, formatTime(r.last_event_at)),
        h("td", {}, h("button", { type: "button", testid: "recoverable-resume",
          onclick: () => showPreview(r.session_id) }, "Resume…")))));
      empty.hidden = shown.length > 0;
      updateRecoverableCount(data.sessions.length);
    } catch (error) {
      if (page === current) showError(errors, error);
    }
  }

  async function showPreview(sessionId) {
    let data;
    try {
      data = await api("GET", `/v1/recoverable/${encodeURIComponent(sessionId)}`);
    } catch (error) {
      notice(error.message, "error");
      return;
    }
    if (page !== current) return;
    resumePreview(preview, sessionId, data, () => {
      location.hash = `#/sessions/${encodeURIComponent(sessionId)}`;
    });
  }

  let debounce = null;
  search.addEventListener("input", () => {
    clearTimeout(debounce);
    debounce = setTimeout(() => { recoverableFilter.query = search.value.trim(); load(); }, 200);
  });
  current.cleanup.push(() => clearTimeout(debounce));
  load();
  every(current, POLL_MS * 2, load);
}

function updateRecoverableCount(n) {
  const count = $("recoverable-count");
  count.textContent = String(n);
  count.hidden = n === 0;
}

async function pollRecoverableCount() {
  try {
    const data = await api("GET", "/v1/recoverable");
    updateRecoverableCount(data.sessions.length);
  } catch (_) { /* shown elsewhere */ }
}

// Workers ----------------------------------------------------------------------------------

function renderWorkers() {
  const current = startPage();
  const body = h("tbody");
  const empty = h("p", { testid: "workers-empty", class: "empty", hidden: true }, "No worker has registered.");
  const errors = h("div");
  $("view").replaceChildren(h("section", { id: "workers-page", testid: "workers-page" },
    h("h1", {}, "Workers"), errors,
    h("table", { id: "workers-table", testid: "workers-table", class: "grid" },
      h("thead", {}, h("tr", {}, ["Worker", "Name", "Alive", "Last heartbeat", "Agents", "Tools",
        "Providers"].map((t) => h("th", {}, t)))), body),
    empty));

  async function load() {
    try {
      const data = await api("GET", "/v1/workers");
      if (page !== current) return;
      errors.replaceChildren();
      body.replaceChildren(...data.workers.map((w) => h("tr",
        { testid: "worker-row", data: { workerId: w.id, alive: String(w.alive) } },
        h("td", { class: "mono" }, w.id),
        h("td", {}, w.name),
        h("td", {}, badge(w.alive ? "alive" : "lost")),
        h("td", { testid: "worker-heartbeat", title: formatTime(w.last_heartbeat) }, ago(w.last_heartbeat)),
        h("td", {}, w.agents.length ? w.agents.join(", ") : "—"),
        h("td", { class: "muted" }, w.tools.join(", ")),
        h("td", { class: "muted" }, w.providers.join(", ")))));
      empty.hidden = data.workers.length > 0;
    } catch (error) {
      if (page === current) showError(errors, error);
    }
  }
  load();
  every(current, POLL_MS, load);
}

// Daemons ----------------------------------------------------------------------------------

function renderDaemons() {
  const current = startPage();
  const body = h("tbody");
  const errors = h("div");
  $("view").replaceChildren(h("section", { id: "daemons-page", testid: "daemons-page" },
    h("h1", {}, "Daemons"), errors,
    h("table", { id: "daemons-table", testid: "daemons-table", class: "grid" },
      h("thead", {}, h("tr", {}, ["Daemon", "Host", "State", "Sessions", "Stranded", "Load",
        "Lease age", "Started", "URL"].map((t) => h("th", {}, t)))), body)));

  async function load() {
    try {
      const data = await api("GET", "/v1/daemons");
      if (page !== current) return;
      errors.replaceChildren();
      body.replaceChildren(...data.daemons.map((d) => h("tr",
        { testid: "daemon-row", data: { daemonId: d.id, state: d.state, this: String(d.this) } },
        h("td", { class: "mono" }, d.this ? `${d.id} (this)` : d.id),
        h("td", {}, d.host),
        h("td", {}, badge(d.state)),
        h("td", { testid: "daemon-sessions" }, String(d.sessions)),
        h("td", {}, String(d.stranded)),
        h("td", {}, String(d.load)),
        h("td", { testid: "daemon-lease-age" }, `${d.lease_age.toFixed(1)} s`),
        h("td", { title: formatTime(d.started_at) }, ago(d.started_at)),
        h("td", { class: "muted" }, d.url))));
    } catch (error) {
      if (page === current) showError(errors, error);
    }
  }
  load();
  every(current, POLL_MS, load);
}

// --- routing -------------------------------------------------------------------------------

function render() {
  const hash = location.hash || "#/sessions";
  const parts = hash.replace(/^#\/?/, "").split("/");
  for (const link of document.querySelectorAll("nav a")) {
    link.classList.toggle("active", link.getAttribute("href") === `#/${parts[0]}`);
  }
  if (parts[0] === "sessions" && parts[1]) renderSession(decodeURIComponent(parts.slice(1).join("/")));
  else if (parts[0] === "recoverable") renderRecoverable();
  else if (parts[0] === "workers") renderWorkers();
  else if (parts[0] === "daemons") renderDaemons();
  else renderSessions();
  pollRecoverableCount();
}

setupTokenDialog();
window.addEventListener("hashchange", render);
render();
setInterval(pollRecoverableCount, 10000);
