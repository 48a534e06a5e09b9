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
//   sessions   sessions-page, session-filter-status (select), session-search (input),
//              sessions-table, session-row (data-session-id, data-status), session-link,
//              sessions-empty, page-error
//   session    session-page (data-session-id), session-id, session-status (data-status),
//              session-goal, session-output, session-reason, session-facts, stream-state
//              (data-state: connecting|live|reconnecting|ended), session-cancel,
//              cancel-confirm-yes, cancel-confirm-no,
//              hitl-list, hitl-pause (data-pause-id), hitl-question, hitl-answer-input,
//              hitl-answer-submit, hitl-error,
//              unknown-outcomes, unknown-outcome,
//              agent-tree, agent-node (data-agent-ref, data-phase, data-resuming="true|false"),
//              agent-phase, agent-resuming-badge, agent-resumes,
//              timeline, timeline-item (data-kind, data-index; class "resume" for
//              AgentResuming/AgentResumed)
//   recovery   recoverable-page, recoverable-table, recoverable-row (data-session-id),
//              recoverable-resume, recoverable-empty, resume-preview (data-session-id),
//              preview-reason, preview-unknown-outcome, preview-no-unknown, preview-pin-diff,
//              preview-no-pins, resume-migrate-pins (checkbox), resume-confirm, resume-back,
//              resume-error
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

const listFilter = { status: "", query: "" };

function renderSessions() {
  const current = startPage();
  const status = h("select", { id: "session-filter-status", testid: "session-filter-status",
    "aria-label": "Filter by status" },
    h("option", { value: "" }, "all statuses"),
    STATUSES.map((s) => h("option", { value: s, selected: s === listFilter.status }, s)));
  const search = h("input", { id: "session-search", testid: "session-search", type: "search",
    placeholder: "Search goal or id", value: listFilter.query, "aria-label": "Search sessions" });
  const body = h("tbody");
  const table = h("table", { id: "sessions-table", testid: "sessions-table", class: "grid" },
    h("thead", {}, h("tr", {}, ["Session", "Status", "Goal", "Events", "Side effects", "Updated"]
      .map((t) => h("th", {}, t)))), body);
  const empty = h("p", { testid: "sessions-empty", class: "empty", hidden: true }, "No sessions match.");
  const errors = h("div");
  $("view").replaceChildren(h("section", { id: "sessions-page", testid: "sessions-page" },
    h("h1", {}, "Sessions"),
    h("div", { class: "toolbar" }, status, search), errors, table, empty));

  async function load() {
    const params = new URLSearchParams({ limit: "200" });
    if (listFilter.status) params.set("status", listFilter.status);
    if (listFilter.query) params.set("q", listFilter.query);
    try {
      const data = await api("GET", `/v1/sessions?${params}`);
      if (page !== current) return;
      errors.replaceChildren();
      body.replaceChildren(...data.sessions.map((s) => h("tr",
        { testid: "session-row", data: { sessionId: s.session_id, status: s.status } },
        h("td", {}, h("a", { href: `#/sessions/${encodeURIComponent(s.session_id)}`,
          testid: "session-link", class: "mono" }, s.session_id)),
        h("td", {}, badge(s.status)),
        h("td", { class: "goal" }, s.goal),
        h("td", { class: "num" }, s.last_index + 1),
        h("td", { class: "num" }, s.side_effects),
        h("td", {}, formatTime(s.updated_at)))));
      empty.hidden = data.sessions.length > 0;
    } catch (error) {
      if (page === current) showError(errors, error);
    }
  }
  status.addEventListener("change", () => { listFilter.status = status.value; load(); });
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

function agentTree(agents) {
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
    return h("li", { testid: "agent-node", class: agent.resuming ? "agent resuming" : "agent",
      data: { agentRef: agent.ref, phase: agent.phase, resuming: String(agent.resuming) } },
      h("div", { class: "agent-line" },
        h("span", { class: `badge phase-${agent.phase}`, testid: "agent-phase" }, agent.phase),
        h("span", { class: "agent-name" }, agent.name),
        h("code", { class: "agent-ref" }, agent.ref),
        agent.resuming ? h("span", { class: "badge resuming", testid: "agent-resuming-badge" }, "resuming") : null,
        agent.resumes ? h("span", { class: "resumes", testid: "agent-resumes",
          title: "times this agent was resumed" }, `resumes: ${agent.resumes}`) : null),
      agent.worker ? h("div", { class: "agent-meta" },
        `on ${agent.worker} · epoch ${agent.epoch}`) : null,
      agent.task ? h("div", { class: "agent-task" }, h("span", { class: "label" }, "task"), agent.task) : null,
      agent.output && agent.phase === "completed"
        ? h("div", { class: "agent-output" }, h("span", { class: "label" }, "output"), agent.output) : null,
      agent.reason ? h("div", { class: `agent-reason reason-${agent.phase}` },
        h("span", { class: "label" }, "why"), agent.reason) : null,
      kids.length ? h("ul", {}, kids.map(node)) : null);
  };
  return roots.map(node);
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
  const hitl = h("div", { id: "hitl-list", testid: "hitl-list", class: "hitl-list" });
  const unknown = h("div", { id: "unknown-outcomes", testid: "unknown-outcomes" });
  const tree = h("ul", { id: "agent-tree", testid: "agent-tree", class: "tree" });
  const timeline = h("ol", { id: "timeline", testid: "timeline", class: "timeline" });
  const errors = h("div");

  $("view").replaceChildren(h("section", { id: "session-page", testid: "session-page",
    data: { sessionId } },
    h("a", { href: "#/sessions", class: "back" }, "← Sessions"),
    h("h1", {}, "Session ", h("code", { id: "session-id", testid: "session-id" }, sessionId), " ",
      status, " ", streamState),
    errors, goal, reason, outputLabel, output, facts, actions, hitl, unknown,
    h("div", { class: "columns" },
      h("section", { class: "panel" }, h("h2", {}, "Agents"), tree),
      h("section", { class: "panel" }, h("h2", {}, "Timeline"), timeline))));

  let view = null;
  let confirming = false;

  function renderActions() {
    const live = view && !["completed", "failed", "cancelled"].includes(view.status);
    if (!live) { actions.replaceChildren(); return; }
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
    actions.replaceChildren(h("button", { type: "button", class: "danger-outline", testid: "session-cancel",
      onclick: () => { confirming = true; renderActions(); } }, "Cancel session…"));
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
    tree.replaceChildren(...agentTree(view.agents));
    unknown.replaceChildren(...(view.unknown_outcomes.length ? [
      h("h2", {}, "Side effects with unknown outcome"),
      h("ul", { class: "unknown" }, view.unknown_outcomes.map((u) => h("li", { testid: "unknown-outcome" },
        h("code", {}, u.tool), ` by ${u.agent} `, h("code", { class: "args" }, JSON.stringify(u.args))))),
    ] : []));
    renderHitl();
    renderActions();
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

  function addEvent(env) {
    const resume = env.kind === "AgentResuming" || env.kind === "AgentResumed";
    // Follow the newest event, unless the operator scrolled up to read older ones.
    const following = timeline.scrollTop + timeline.clientHeight >= timeline.scrollHeight - 24;
    timeline.append(h("li", { testid: "timeline-item", class: resume ? "resume" : "",
      data: { kind: env.kind, index: String(env.index) } },
      h("span", { class: "idx" }, `#${env.index}`),
      h("time", {}, new Date(env.ts * 1000).toLocaleTimeString()),
      h("span", { class: `kind kind-${env.kind}` }, env.kind),
      h("span", { class: "what" }, describe(env))));
    while (timeline.children.length > TIMELINE_MAX) timeline.firstElementChild.remove();
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
  every(current, POLL_MS * 2, () => {
    if (view && !["completed", "failed", "cancelled"].includes(view.status)) refreshSoon();
  });

  refresh().then(() => {
    if (page !== current) return;
    followEvents(sessionId, -1, { onEvent: addEvent, onState: setStream, signal: controller.signal })
      .then(() => { if (page === current) refresh(); });
  });
}

// Recoverable sessions ---------------------------------------------------------------------

function renderRecoverable() {
  const current = startPage();
  const body = h("tbody");
  const empty = h("p", { testid: "recoverable-empty", class: "empty", hidden: true },
    "No session is waiting for an operator.");
  const preview = h("section", { id: "resume-preview", testid: "resume-preview", class: "preview", hidden: true });
  const errors = h("div");
  $("view").replaceChildren(h("section", { id: "recoverable-page", testid: "recoverable-page" },
    h("h1", {}, "Recoverable sessions"),
    h("p", { class: "muted" }, "Sessions the daemon would not resume on its own. Check what " +
      "resuming faces before you confirm."),
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
      body.replaceChildren(...data.sessions.map((r) => h("tr",
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
      empty.hidden = data.sessions.length > 0;
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
        location.hash = `#/sessions/${encodeURIComponent(sessionId)}`;
      } catch (err) {
        error.textContent = err.message;
        confirm.disabled = false;
      }
    });
    preview.dataset.sessionId = sessionId;
    preview.replaceChildren(
      h("h2", {}, "Resume ", h("code", {}, sessionId), "?"),
      h("p", { testid: "preview-reason" }, `Stranded because: ${data.reason}`),
      h("h3", {}, "Side effects with unknown outcome"),
      data.unknown_outcomes.length
        ? h("ul", { class: "unknown" }, data.unknown_outcomes.map((u) => h("li", { testid: "preview-unknown-outcome" },
          h("code", {}, u.tool), ` by ${u.agent} `, h("code", { class: "args" }, JSON.stringify(u.args)),
          h("span", { class: "muted" }, ` key ${u.key.slice(0, 12)}…`))))
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
          onclick: () => { preview.hidden = true; } }, "Back"), " ", confirm),
      error);
    preview.hidden = false;
    preview.scrollIntoView({ block: "nearest" });
  }

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
