/*
 * Fairway chat page. Plain JS, no build step: served as-is by the gateway at /web/app.js.
 *
 * It talks to the same API as any client (see README):
 *   GET  /v1/models, GET /v1/conversations, GET /v1/conversations/{id}
 *   POST /v1/chat/completions            (stream: true -> SSE, every event has `id: n`)
 *   GET  /v1/replies/{id}/stream         (resume after `Last-Event-ID: n`)
 *   POST /v1/replies/{id}/stop
 *
 * Streams are read with fetch() + ReadableStream rather than EventSource, because EventSource
 * can neither POST nor send an Authorization header.
 */
'use strict';

const KEY_STORAGE = 'fairway.apiKey';
const MAX_TOKENS_STORAGE = 'fairway.maxTokens';
const CODE_TOOL_STORAGE = 'fairway.codeTool'; // the "Run code" switch: offer the built-in code tool

// Reconnect policy: exponential backoff with "equal jitter" (half fixed, half random), so a
// crowd of clients dropped by the same network blip does not come back in lockstep.
const BACKOFF_BASE_MS = 300;
const BACKOFF_CAP_MS = 10000;
const MAX_ATTEMPTS = 20; // a couple of minutes at the cap; the server keeps a reply's log 30 min
// The server sends an SSE comment every 10 s while nothing happens. A connection that stays
// silent much longer than that is dead even if TCP has not noticed (e.g. a Wi-Fi switch).
const SILENT_CONNECTION_MS = 30000;

const $ = (id) => document.getElementById(id);

const state = {
  model: null, // the model new conversations use (the first one /v1/models lists)
  conversationId: null, // the conversation on screen; null for a new chat
  current: null, // the ReplyStream shown on screen, while it runs
  attachments: [], // files for the next message: {name, status, progress, fileId, detail}
  sendWhenReady: false, // Send was pressed while a file was still uploading or processing
};

// -- errors ------------------------------------------------------------------------------------

/** An HTTP error response, with the message from the API's {"error": {...}} body. */
class HttpError extends Error {
  constructor(status, message, retryAfterS, code = null, headers = null) {
    super(message);
    this.status = status;
    this.retryAfterS = retryAfterS;
    this.code = code; // the API's error code, e.g. content_policy_violation
    this.headers = headers;
  }
}

/** Something reconnecting cannot fix (the reply failed on the server, a bad request...). */
class FatalError extends Error {}

function isRetryable(err) {
  if (err instanceof FatalError) return false;
  if (err instanceof HttpError) return err.status >= 500 || err.status === 408 || err.status === 429;
  // Everything else is the network: fetch() rejecting, or the body's reader failing mid-stream
  // (TypeError), or our own watchdog aborting a silent connection (AbortError).
  return true;
}

// -- the API -----------------------------------------------------------------------------------

function apiKey() {
  return localStorage.getItem(KEY_STORAGE) || '';
}

async function api(path, { method = 'GET', body, headers = {}, signal } = {}) {
  const init = { method, signal, headers: { Authorization: `Bearer ${apiKey()}`, ...headers } };
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await httpError(response);
  return response;
}

async function apiJson(path, options) {
  return (await api(path, options)).json();
}

async function httpError(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
    if (body && body.error) code = body.error.code || null;
  } catch (_) {
    // not JSON: keep the status line
  }
  if (response.status === 401) askForKey(`The server did not accept this key: ${message}`);
  const retryAfter = Number(response.headers.get('Retry-After'));
  return new HttpError(response.status, message, Number.isFinite(retryAfter) ? retryAfter : null, code,
    response.headers);
}

/**
 * The events of an SSE response, as {id, data} (comments skipped), framed as the SSE spec says:
 * lines, with a blank line ending each event. onActivity runs on every chunk of bytes, so the
 * caller can tell a live connection (keepalives included) from a dead one.
 */
async function* readSSE(response, onActivity) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  let id = null;
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      onActivity();
      buffer += decoder.decode(value, { stream: true });
      let newline;
      while ((newline = buffer.indexOf('\n')) >= 0) {
        const line = buffer.slice(0, newline).replace(/\r$/, '');
        buffer = buffer.slice(newline + 1);
        if (line === '') {
          if (data.length) yield { id, data: data.join('\n') };
          id = null;
          data = [];
        } else if (line.startsWith(':')) {
          // a comment: the server's keepalive
        } else {
          const colon = line.indexOf(':');
          const field = colon < 0 ? line : line.slice(0, colon);
          const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
          if (field === 'id') id = /^\d+$/.test(value) ? Number(value) : null;
          else if (field === 'data') data.push(value);
        }
      }
    }
  } finally {
    // Leaving early (after [DONE], or on an error) closes the connection.
    reader.cancel().catch(() => {});
  }
}

// -- backoff -----------------------------------------------------------------------------------

function backoffDelay(attempt) {
  const ceiling = Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** (attempt - 1));
  return ceiling / 2 + Math.random() * (ceiling / 2);
}

/** Wait ms, or less if the browser says the network is back: no point waiting longer then. */
function sleepUnlessOnline(ms) {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      window.removeEventListener('online', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    window.addEventListener('online', done);
  });
}

// -- one streamed reply ------------------------------------------------------------------------

/**
 * One reply, from its first event to its final one, across as many connections as it takes.
 *
 * Every event carries its number n (the SSE `id:`). After a drop we ask the server for the
 * events after the last n we have, and skip any n we already have, so the text never repeats
 * or misses a token however the connection broke.
 */
class ReplyStream {
  constructor(request, view, replyId = null) {
    this.request = request; // the POST body; its message_id makes re-sending it safe
    this.view = view;
    this.replyId = null;
    this.lastEventId = 0;
    this.text = '';
    this.finished = false;
    this.finishReason = null;
    this.stopped = false;
    this.failed = null;
    this.error = null; // what failed it, to tell a message the server refused from a lost reply
    this.refused = null; // the input check's refusal: {message, categories}
    this.filtered = []; // the categories the output check stopped the reply for
    this.stopWanted = false;
    this.notice = null; // what the status line says while nothing else needs it
    this.onDone = () => {};
    if (replyId) this.learnReplyId(replyId); // following a reply that is already running
  }

  async run() {
    let attempt = 0;
    while (!this.finished && !this.failed) {
      const progressBefore = this.lastEventId;
      try {
        await this.connectOnce();
        if (!this.finished) throw new Error('the stream ended before the reply did');
      } catch (err) {
        if (this.finished) break;
        if (err instanceof HttpError && err.code === 'content_policy_violation') {
          // The message was refused and stored flagged: nothing to retry, and later turns go on
          // in the same conversation.
          this.learnConversation(err.headers.get('X-Conversation-Id'));
          this.refused = { message: err.message, categories: (err.headers.get('X-Flagged-Categories') || '').split(',') };
          break;
        }
        if (!isRetryable(err)) {
          this.failed = err.message;
          this.error = err;
          break;
        }
        // Events arrived on that connection, so it was good: start the backoff over.
        if (this.lastEventId > progressBefore) attempt = 0;
        attempt += 1;
        if (attempt > MAX_ATTEMPTS) {
          this.failed = `Lost the connection to the server (${err.message}).`;
          this.error = err;
          break;
        }
        const delay = err.retryAfterS ? err.retryAfterS * 1000 : backoffDelay(attempt);
        this.showStatus(`Connection lost — reconnecting in ${(delay / 1000).toFixed(1)} s (attempt ${attempt})…`);
        await sleepUnlessOnline(delay);
        this.showStatus('Reconnecting…');
      }
    }
    this.notice = null;
    this.showStatus(null);
    if (this.refused) this.view.refuse(this.refused);
    else if (!this.notSent()) this.view.finish(this.status(), this.failed, this.filtered, this.finishReason);
    this.onDone(this); // a message not sent: the caller takes it back (startReply's onNotSent)
  }

  /**
   * The server refused the message before storing it: an HTTP error answered the request itself,
   * before any event, and named no stored message (X-Message-Id marks one: a shed reply's, or a
   * message refused by the input check, which is kept flagged).
   */
  notSent() {
    const err = this.error;
    return err instanceof HttpError && !this.replyId && this.lastEventId === 0
      && !(err.headers && err.headers.get('X-Message-Id'));
  }

  /** As the store says it: complete, stopped or flagged (plus error, which only we see). */
  status() {
    if (this.failed) return 'error';
    if (this.stopped) return 'stopped';
    return this.finishReason === 'content_filter' ? 'flagged' : 'complete';
  }

  /** One connection: resume by reply id once we know it, else (re-)send the request. */
  async connectOnce() {
    const controller = new AbortController();
    let watchdog = null;
    const alive = () => {
      clearTimeout(watchdog);
      watchdog = setTimeout(() => controller.abort(), SILENT_CONNECTION_MS);
    };
    alive();
    try {
      let response;
      if (this.replyId) {
        response = await api(`/v1/replies/${encodeURIComponent(this.replyId)}/stream`, {
          headers: { 'Last-Event-ID': String(this.lastEventId) },
          signal: controller.signal,
        });
      } else {
        // Nothing heard yet, not even the reply id. Re-sending the same request is safe: the
        // server finds the message by its message_id and attaches to the reply it already
        // started for it instead of starting a second one.
        response = await api('/v1/chat/completions', { method: 'POST', body: this.request, signal: controller.signal });
      }
      this.showStatus(null);
      this.learnReplyId(response.headers.get('X-Reply-Id'));
      this.learnConversation(response.headers.get('X-Conversation-Id'));
      for await (const event of readSSE(response, alive)) {
        if (event.data === '[DONE]') return;
        this.handle(event);
      }
    } finally {
      clearTimeout(watchdog);
    }
  }

  handle(event) {
    let chunk;
    try {
      chunk = JSON.parse(event.data);
    } catch (_) {
      console.warn('Fairway: skipped an event that is not JSON', event);
      return;
    }
    if (chunk.error) throw new FatalError(chunk.error.message || 'The reply failed.');
    this.learnReplyId(chunk.reply_id);
    this.learnConversation(chunk.conversation_id);
    if (chunk.context && this.view.setContext) this.view.setContext(chunk.context);
    if (event.id !== null) {
      if (event.id <= this.lastEventId) return; // a replay of what we have: the dedupe
      this.lastEventId = event.id;
    }
    // A built-in tool's run: the reply is paused while it runs, then its code and output are
    // shown folded under the reply, which carries on.
    if (chunk.tool_execution) this.view.tool(chunk.tool_execution);
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) return; // the usage chunk
    const content = (choice.delta && choice.delta.content) || '';
    // A snapshot is the whole stored text (the reply's token log had expired): it replaces ours.
    this.text = chunk.snapshot ? content : this.text + content;
    this.view.update(this.text);
    if (choice.finish_reason) {
      this.finished = true;
      this.finishReason = choice.finish_reason;
      this.stopped = Boolean(chunk.stopped || choice.stopped);
      this.filtered = Object.keys(choice.content_filter_results || {});
    }
  }

  learnReplyId(replyId) {
    if (!replyId || this.replyId) return;
    this.replyId = replyId;
    this.view.setReplyId(replyId);
    if (this.stopWanted) this.sendStop(); // Stop was pressed before we knew what to stop
  }

  learnConversation(conversationId) {
    if (!conversationId || this.request.conversation_id) return;
    // A new chat: every later turn continues this conversation.
    this.request.conversation_id = conversationId;
    if (state.current === this) {
      state.conversationId = conversationId;
      // The new chat is now this conversation: the same history entry, not a new one.
      showInUrl(conversationId, { replace: true });
      refreshConversations();
    }
  }

  /** Ask the server to stop; the final chunk (marked stopped) then comes down the stream. */
  stop() {
    this.stopWanted = true;
    if (this.replyId) this.sendStop();
  }

  async sendStop() {
    for (let attempt = 1; attempt <= 5 && !this.finished; attempt++) {
      try {
        await api(`/v1/replies/${encodeURIComponent(this.replyId)}/stop`, { method: 'POST' });
        return;
      } catch (err) {
        if (!isRetryable(err)) return;
        await sleepUnlessOnline(backoffDelay(attempt));
      }
    }
  }

  showStatus(text) {
    if (state.current === this) showStatus(text ?? this.notice);
  }
}

// -- rendering ---------------------------------------------------------------------------------

const BADGES = { stopped: 'stopped', flagged: 'stopped by the content filter', error: 'error' };
// A reply that ran out of max_tokens is stored as complete: its finish_reason says so (the live
// stream's final chunk, or the stored message's finish_reason on reopen).
const CUT_OFF_BADGE = 'cut off at the token limit';
const USER_BADGES = { flagged: 'refused by the content filter: not sent to the model' };

/** What a badge says: which categories, when we know them (stored messages keep them too). */
function filterText(text, categories) {
  return categories && categories.length ? `${text} (${categories.join(', ')})` : text;
}

function messageElement(role, text, status, categories, finishReason = null) {
  const el = document.createElement('div');
  el.className = `msg ${role}`;
  el.dataset.status = status;
  const label = document.createElement('div');
  label.className = 'role';
  label.textContent = role === 'user' ? 'You' : role === 'assistant' ? 'Assistant' : role;
  const body = document.createElement('div');
  body.className = 'body';
  // The assistant's markdown is rendered (as DOM nodes: markdown.js); anything else is shown as
  // written. Never innerHTML: neither the model's output nor the user's text is trusted markup.
  if (role === 'assistant') showMarkdown(body, text);
  else body.textContent = text;
  el.append(label, body);
  if (role === 'user') {
    if (USER_BADGES[status]) addBadge(el, status, filterText(USER_BADGES[status], categories));
  } else {
    addEndBadge(el, status, { categories, finishReason });
  }
  return el;
}

/**
 * The files a user message attached, under its text: as it is sent, and as a reopened
 * conversation lists them (a file deleted since still named, and said to be).
 */
function attachedNote(files) {
  const note = document.createElement('div');
  note.className = 'attached';
  // textContent: a file's name is the user's text, never markup.
  note.textContent = `Attached: ${files.map((f) => (f.deleted ? `${f.name} (deleted)` : f.name)).join(', ')}`;
  return note;
}

/** A reply's text, rendered; the text as written stays in data-source (rendering drops its marks). */
function showMarkdown(body, text) {
  body.replaceChildren(Markdown.render(text));
  body.dataset.source = text;
}

/** The badge that says how a reply ended, unless it simply completed: live and reopened alike. */
function addEndBadge(el, status, { categories = null, finishReason = null, error = null } = {}) {
  if (status === 'error') addBadge(el, 'error', error || BADGES.error);
  else if (status === 'flagged') addBadge(el, status, filterText(BADGES.flagged, categories));
  else if (BADGES[status]) addBadge(el, status, BADGES[status]);
  else if (finishReason === 'length') addBadge(el, 'length', CUT_OFF_BADGE);
}

/** What an answer's context held beyond the conversation (file chunks, memories), or null. */
function sourcesElement(context) {
  const parts = [];
  for (const s of (context && context.sources) || []) {
    parts.push(`${s.filename}, chunk ${s.chunk}${s.page ? `, page ${s.page}` : ''}`);
  }
  if (context && context.memories) parts.push(`${context.memories} ${context.memories === 1 ? 'memory' : 'memories'}`);
  if (!parts.length) return null;
  const el = document.createElement('div');
  el.className = 'sources';
  el.textContent = `Used: ${parts.join('; ')}`;
  return el;
}

/** A tool run as the page shows it: running (name and a spinner), or done (folded code and output). */
function toolElement(run) {
  const code = run.code ?? run.arguments ?? '';
  if (run.status === 'running') {
    const el = document.createElement('div');
    el.className = 'tool-run running';
    el.dataset.callId = run.id;
    const spinner = document.createElement('span');
    spinner.className = 'spinner';
    const label = document.createElement('span');
    label.textContent = `Running ${run.name}…`;
    el.append(spinner, label);
    return el;
  }
  const el = document.createElement('details');
  el.className = `tool-run ${run.status}`;
  el.dataset.callId = run.id;
  const summary = document.createElement('summary');
  summary.textContent = `${run.status === 'completed' ? 'Ran' : 'Tried'} ${run.name}`;
  const codeEl = document.createElement('pre');
  codeEl.className = 'code';
  codeEl.textContent = code; // textContent: the model's code and its output are not trusted markup
  const output = document.createElement('pre');
  output.className = 'output';
  output.textContent = run.output || '';
  el.append(summary, codeEl, output);
  return el;
}

/** A stored message's built-in tool runs, as toolElement reads them. */
function storedRuns(m) {
  return (m.tool_executions || []).map((r) => {
    let code = r.arguments;
    try { code = JSON.parse(r.arguments).code ?? r.arguments; } catch (_) { /* shown as it is */ }
    return { id: r.id, name: r.name, status: r.status, code, output: r.output };
  });
}

function addBadge(el, kind, text) {
  const badge = document.createElement('span');
  badge.className = `badge ${kind}`;
  badge.textContent = text;
  el.append(badge);
}

/**
 * Change what the messages show, and if they were scrolled to the bottom keep them there: the
 * page follows a reply (and its badges) unless the user scrolled up to read.
 */
function keepingBottom(change) {
  const box = $('messages');
  const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  change();
  if (atBottom) box.scrollTop = box.scrollHeight;
}

function appendMessage(el) {
  keepingBottom(() => {
    $('messages').querySelector('.empty')?.remove();
    $('messages').append(el);
  });
}

/** The assistant message a ReplyStream writes into. */
class AssistantView {
  constructor() {
    this.el = messageElement('assistant', '', 'streaming');
    this.body = this.el.querySelector('.body');
    this.pending = null; // the newest text, not rendered yet
    this.frame = null;
  }

  /** Tokens arrive faster than the screen refreshes, and each render redoes the whole text: the
   * newest text is rendered once, at the next frame. */
  update(text) {
    this.pending = text;
    if (this.frame === null) this.frame = requestAnimationFrame(() => this.render());
  }

  /** Render the pending text now (before what must follow it on screen: a tool run, a badge). */
  render() {
    cancelAnimationFrame(this.frame);
    this.frame = null;
    if (this.pending === null) return;
    const text = this.pending;
    this.pending = null;
    keepingBottom(() => showMarkdown(this.body, text));
  }

  setReplyId(replyId) {
    this.el.dataset.replyId = replyId;
  }

  /** What the context held beyond the conversation: the file chunks the answer may cite. */
  setContext(context) {
    if (this.el.querySelector('.sources')) return;
    const el = sourcesElement(context);
    if (el) this.el.append(el);
  }

  finish(status, error, categories, finishReason) {
    this.render();
    // The badge must not end up under the composer (an error's can be a few lines long).
    keepingBottom(() => {
      this.el.dataset.status = status;
      addEndBadge(this.el, status, { categories, finishReason, error });
    });
  }

  /** A tool run: a spinner while it runs, then its code and output, folded. */
  tool(run) {
    this.render(); // the text before the run shows before it
    let el = this.el.querySelector(`.tool-run[data-call-id="${CSS.escape(run.id)}"]`);
    if (!el) {
      el = document.createElement('div');
      el.className = 'tool-run';
      el.dataset.callId = run.id;
      this.toolsBox().append(el);
    }
    keepingBottom(() => el.replaceWith(toolElement(run))); // a run's output can be long
  }

  toolsBox() {
    let box = this.el.querySelector('.tools');
    if (!box) {
      box = document.createElement('div');
      box.className = 'tools';
      this.body.after(box);
    }
    return box;
  }

  /** The input check refused the message: it is marked, and no reply follows it. */
  refuse(refused) {
    cancelAnimationFrame(this.frame);
    const user = this.el.previousElementSibling;
    keepingBottom(() => {
      if (user && user.classList.contains('user')) {
        user.dataset.status = 'flagged';
        addBadge(user, 'flagged', filterText(USER_BADGES.flagged, refused.categories.filter(Boolean)));
        user.title = refused.message;
      }
      this.el.remove();
    });
  }
}

function showStatus(text) {
  const el = $('status');
  el.hidden = !text;
  el.textContent = text || '';
}

function setStreaming(streaming) {
  $('send').hidden = streaming;
  $('stop').hidden = !streaming;
}

function showEmpty() {
  const box = $('messages');
  box.replaceChildren();
  const empty = document.createElement('div');
  empty.className = 'empty';
  empty.textContent = 'Ask anything.';
  box.append(empty);
}

// -- conversations -----------------------------------------------------------------------------

async function refreshConversations() {
  let list;
  try {
    list = await apiJson('/v1/conversations?limit=50');
  } catch (err) {
    console.warn('Fairway: could not list conversations', err);
    return;
  }
  const ul = $('conversations');
  ul.replaceChildren(
    ...list.data.map((c) => {
      const li = document.createElement('li');
      li.title = c.title || '';
      li.dataset.id = c.id;
      if (c.id === state.conversationId) li.classList.add('active');
      li.addEventListener('click', () => openConversation(c.id));
      const title = document.createElement('span');
      title.className = 'title';
      title.textContent = c.title || 'Untitled';
      const remove = document.createElement('button');
      remove.type = 'button';
      remove.className = 'delete-conversation';
      remove.textContent = '×';
      remove.title = 'Delete this conversation';
      remove.setAttribute('aria-label', `Delete ${c.title || 'Untitled'}`);
      remove.addEventListener('click', (event) => {
        event.stopPropagation(); // not an open as well
        deleteConversation(c);
      });
      li.append(title, remove);
      return li;
    }),
  );
  const active = list.data.find((c) => c.id === state.conversationId);
  if (active) $('conversation-title').textContent = active.title || 'Untitled';
}

/** Delete a conversation for good, once the user confirms; if it was open, a new chat replaces it. */
async function deleteConversation(c) {
  if (!confirm(`Delete "${c.title || 'Untitled'}"? This cannot be undone.`)) return;
  if (state.conversationId === c.id && state.current) state.current.stop(); // nothing to keep it for
  try {
    await api(`/v1/conversations/${encodeURIComponent(c.id)}`, { method: 'DELETE' });
  } catch (err) {
    // 404: already gone (deleted in another tab), which is what the user wanted.
    if (!(err instanceof HttpError && err.status === 404)) {
      showStatus(`Could not delete the conversation: ${err.message}`);
      return;
    }
  }
  if (state.conversationId === c.id) newChat({ replace: true }); // Back must not lead to it
  await refreshConversations();
}

/** Leave the reply on screen running in the background: a reply nobody listens to gets cancelled. */
function detachCurrent() {
  state.current = null;
  state.sendWhenReady = false; // it was meant for the conversation on screen
  setStreaming(false);
  showStatus(null);
}

// The open conversation lives in the URL's hash (#conv_...): a reload reopens it (and picks up
// a reply still being written, before the server cancels it for want of a listener), and the
// browser's back and forward move between conversations.

/** The conversation the URL names, or null. */
function conversationInUrl() {
  try {
    return decodeURIComponent(location.hash.slice(1)) || null;
  } catch (_) {
    return null; // a malformed hash (a bad %-escape) names nothing
  }
}

/** Put a conversation (or none: a new chat) in the URL, as a new history entry unless replace. */
function showInUrl(id, { replace = false } = {}) {
  if (conversationInUrl() === id) return;
  const url = id ? `#${encodeURIComponent(id)}` : `${location.pathname}${location.search}`;
  if (replace) history.replaceState(null, '', url);
  else history.pushState(null, '', url);
}

/** Back, forward, or a hash typed in: show what the URL names now. */
function followUrl() {
  const id = conversationInUrl();
  if (id === state.conversationId) return;
  if (id) openConversation(id, { fromUrl: true });
  else newChat({ fromUrl: true });
}

function newChat({ fromUrl = false, replace = false } = {}) {
  detachCurrent();
  state.conversationId = null;
  if (!fromUrl) showInUrl(null, { replace });
  $('conversation-title').textContent = 'New chat';
  showEmpty();
  for (const li of $('conversations').children) li.classList.remove('active');
  $('prompt').focus();
}

/**
 * Show a stored conversation, and follow its reply if one is still being written: attachTo names
 * it (a 409 conversation_busy's X-Reply-Id), else the last user message's client_key finds it.
 */
async function openConversation(id, { fromUrl = false, attachTo = null, notice = null } = {}) {
  detachCurrent();
  state.conversationId = id;
  if (!fromUrl) showInUrl(id);
  for (const li of $('conversations').children) li.classList.toggle('active', li.dataset.id === id);
  let conversation;
  try {
    conversation = await apiJson(`/v1/conversations/${encodeURIComponent(id)}`);
  } catch (err) {
    if (state.conversationId !== id) return;
    if (err instanceof HttpError && err.status === 404) {
      // Deleted (or another user's link): a new chat rather than a page stuck on an error.
      newChat({ replace: true });
      showStatus('That conversation no longer exists.');
      return;
    }
    showStatus(`Could not open the conversation: ${err.message}`);
    return;
  }
  if (state.conversationId !== id) return; // another one was opened meanwhile
  $('conversation-title').textContent = conversation.title || 'Untitled';
  const box = $('messages');
  box.replaceChildren();
  for (const m of conversation.messages) {
    const el = messageElement(m.role, m.content, m.status, m.flagged_categories, m.finish_reason);
    if (m.reply_id) el.dataset.replyId = m.reply_id;
    if (m.attachments && m.attachments.length) {
      el.append(attachedNote(m.attachments.map((a) => ({ name: a.filename, deleted: a.deleted }))));
    }
    const runs = storedRuns(m);
    if (runs.length) {
      const tools = document.createElement('div');
      tools.className = 'tools';
      tools.append(...runs.map(toolElement));
      el.querySelector('.body').after(tools);
    }
    const used = sourcesElement(m.context); // the file chunks (and memories) the answer was given
    if (used) el.append(used);
    box.append(el);
  }
  if (!conversation.messages.length) showEmpty();
  box.scrollTop = box.scrollHeight;
  // A last user message without an answer has its reply still running (or it was lost):
  // pick it up from its first event. The server answers 404 if there is nothing to resume.
  const last = conversation.messages[conversation.messages.length - 1];
  if (attachTo) {
    // Unless it ended meanwhile (then it is stored, and the way is clear to send).
    if (!conversation.messages.some((m) => m.reply_id === attachTo)) {
      startReply({ conversation_id: id }, { quietIfMissing: true, replyId: attachTo, notice });
    } else if (notice) {
      showStatus('The earlier reply has just finished: send again.');
    }
  } else if (last && last.role === 'user' && last.client_key) {
    startReply(
      {
        model: conversation.model || state.model,
        conversation_id: id,
        message_id: last.client_key,
        messages: [{ role: 'user', content: last.content }],
        stream: true,
        last_received_token_index: 0,
      },
      { quietIfMissing: true },
    );
  }
}

// -- sending -----------------------------------------------------------------------------------

const isPending = (a) => a.status === 'uploading' || a.status === 'processing';

/** Send what the composer holds (text, files or both), once it can be sent. */
function trySend() {
  const prompt = $('prompt');
  const text = prompt.value.trim();
  state.sendWhenReady = false;
  if ((!text && !state.attachments.length) || state.current) return;
  const failed = state.attachments.find((a) => a.status === 'failed');
  if (failed) {
    // Not sent without it, silently: the user meant to send it.
    showStatus(`${failed.name} could not be attached: remove it (×) to send without it.`);
    return;
  }
  if (state.attachments.some(isPending)) {
    // Sent by renderAttachments once every file is ready: Send was pressed already.
    state.sendWhenReady = true;
    showStatus('Waiting for the attached file to be ready…');
    return;
  }
  showStatus(null);
  if (!state.model) {
    showStatus('No model is available yet: try again in a moment.');
    loadAll();
    return;
  }
  prompt.value = '';
  send(text);
}

function maxTokens() {
  const value = Number($('max-tokens').value);
  return Number.isInteger(value) && value > 0 ? value : null;
}

function send(text) {
  const files = state.attachments.filter((a) => a.status === 'ready');
  const userEl = messageElement('user', text, 'complete');
  if (files.length) userEl.append(attachedNote(files));
  appendMessage(userEl);
  // Files alone are a message too: the server then gives the model the files' opening chunks.
  const content = files.length
    ? [...(text ? [{ type: 'text', text }] : []), ...files.map((f) => ({ type: 'file_url', file_id: f.fileId }))]
    : text;
  const conversationId = state.conversationId;
  state.attachments = [];
  renderAttachments();
  const request = {
    model: state.model,
    messages: [{ role: 'user', content }],
    stream: true,
    // Ours, not the server's: with it a re-sent request (after a drop before any event
    // arrived) attaches to the reply already running instead of starting another.
    message_id: `msg_${crypto.randomUUID()}`,
  };
  if (state.conversationId) request.conversation_id = state.conversationId;
  if ($('code-tool').checked && !$('code-tool').disabled) request.tools = [{ type: 'code_interpreter' }];
  const limit = maxTokens();
  if (limit) request.max_tokens = limit;
  startReply(request, { onNotSent: (err) => takeBack(userEl, text, files, conversationId, err) });
}

const BUSY_NOTICE = 'A reply is still being written in this chat — wait for it, or stop it, then send again.';

/**
 * The server refused the message before storing it (too long, the conversation busy, a bad
 * key...): nothing of it is kept, so the page keeps nothing either. Its bubble goes, and its
 * text and files go back into the composer, to shorten or send again.
 */
function takeBack(userEl, text, files, conversationId, err) {
  userEl.remove();
  if (!$('messages').querySelector('.msg')) showEmpty();
  const prompt = $('prompt');
  prompt.value = prompt.value ? `${text}\n${prompt.value}` : text; // anything typed since stays too
  state.attachments.unshift(...files.filter((f) => !state.attachments.includes(f)));
  renderAttachments();
  if (err.code === 'conversation_busy' && conversationId) {
    // Another tab (or client) is being answered in this conversation: show that reply, from its
    // first event, so the user sees what it is and can Stop it.
    openConversation(conversationId, { attachTo: err.headers.get('X-Reply-Id'), notice: BUSY_NOTICE });
    showStatus(BUSY_NOTICE);
  } else {
    showStatus(`Not sent: ${err.message}`);
  }
}

/**
 * Show a reply as it streams. onNotSent(err) runs when the server refused the message before
 * storing it (see ReplyStream.notSent); replyId follows a reply already running.
 */
function startReply(request, { quietIfMissing = false, onNotSent = null, replyId = null, notice = null } = {}) {
  const view = new AssistantView();
  appendMessage(view.el);
  const stream = new ReplyStream(request, view, replyId);
  stream.notice = notice;
  state.current = stream;
  setStreaming(true);
  stream.showStatus(null);
  stream.onDone = () => {
    const notSent = stream.notSent();
    if (notSent || (quietIfMissing && stream.failed && !stream.text)) view.el.remove(); // nothing was running
    if (state.current !== stream) return; // the user moved on to another conversation
    state.current = null;
    setStreaming(false);
    refreshConversations();
    if (notSent && onNotSent) onNotSent(stream.error);
  };
  stream.run();
}

// -- attachments -------------------------------------------------------------------------------

/** Upload with progress (XMLHttpRequest: fetch has no upload progress), then poll until ready. */
function attachFile(file) {
  const item = { name: file.name, status: 'uploading', progress: 0, fileId: null, detail: '' };
  state.attachments.push(item);
  renderAttachments();
  const form = new FormData();
  form.append('file', file);
  form.append('purpose', 'multimodal_input');
  const xhr = new XMLHttpRequest();
  item.xhr = xhr; // to abort the upload if the file is removed
  xhr.open('POST', '/v1/files/upload');
  xhr.setRequestHeader('Authorization', `Bearer ${apiKey()}`);
  xhr.upload.onprogress = (event) => {
    if (event.lengthComputable) item.progress = Math.round((100 * event.loaded) / event.total);
    renderAttachments();
  };
  xhr.onload = () => {
    let body = null;
    try {
      body = JSON.parse(xhr.responseText);
    } catch (_) {
      // not JSON: the status line says it
    }
    if (xhr.status !== 200 || !body) {
      item.status = 'failed';
      item.detail = (body && body.error && body.error.message) || `upload failed (${xhr.status})`;
      renderAttachments();
      return;
    }
    item.fileId = body.file_id;
    item.status = body.status;
    if (item.removed) {
      removeAttachment(item); // removed while its answer was on the way: delete the file now
      return;
    }
    renderAttachments();
    pollFile(item);
  };
  xhr.onerror = () => {
    item.status = 'failed';
    item.detail = 'the upload was interrupted';
    renderAttachments();
  };
  xhr.send(form);
}

async function pollFile(item) {
  while (item.status === 'processing' && !item.removed) {
    await new Promise((resolve) => setTimeout(resolve, 500));
    try {
      const file = await apiJson(`/v1/files/${encodeURIComponent(item.fileId)}`);
      item.status = file.status;
      item.detail = file.status_details || '';
    } catch (err) {
      if (!isRetryable(err)) {
        item.status = 'failed';
        item.detail = err.message;
      }
    }
    renderAttachments();
  }
}

/** A file taken off the next message: a failed one, or the wrong one. */
function removeAttachment(item) {
  item.removed = true; // its upload or polling may still report: nobody listens
  state.attachments = state.attachments.filter((a) => a !== item);
  if (item.status === 'uploading' && item.xhr) item.xhr.abort();
  // Uploaded for this message only, and now for none: don't leave it in the user's files.
  if (item.fileId) api(`/v1/files/${encodeURIComponent(item.fileId)}`, { method: 'DELETE' }).catch(() => {});
  renderAttachments();
}

/** Show the files for the next message; and send it, if Send was waiting for them. */
function renderAttachments() {
  $('attachments').replaceChildren(
    ...state.attachments.map((a) => {
      const li = document.createElement('li');
      li.dataset.status = a.status;
      if (a.fileId) li.dataset.fileId = a.fileId;
      const label = document.createElement('span');
      label.className = 'label';
      const what = a.status === 'uploading' ? `uploading ${a.progress}%` : a.status;
      label.textContent = `${a.name}: ${what}${a.detail ? ` (${a.detail})` : ''}`;
      const remove = document.createElement('button');
      remove.type = 'button';
      remove.className = 'remove-attachment';
      remove.textContent = '×';
      remove.title = `Remove ${a.name}`;
      remove.setAttribute('aria-label', `Remove ${a.name}`);
      remove.addEventListener('click', () => removeAttachment(a));
      li.append(label, remove);
      return li;
    }),
  );
  if (state.sendWhenReady && !state.attachments.some(isPending)) {
    showStatus(null); // the wait is over, whatever trySend says next
    trySend();
  }
}

// -- memory ------------------------------------------------------------------------------------

async function openMemory() {
  const dialog = $('memory-dialog');
  if (!dialog.open) dialog.showModal();
  await renderMemory();
}

async function renderMemory() {
  const list = $('memory-list');
  $('memory-error').hidden = true;
  let body;
  try {
    body = await apiJson('/v1/user/memory');
  } catch (err) {
    $('memory-error').textContent = err.message;
    $('memory-error').hidden = false;
    list.replaceChildren();
    return;
  }
  $('memory-enabled').checked = body.enabled;
  if (!body.memories.length) {
    const li = document.createElement('li');
    li.className = 'empty';
    li.textContent = 'Nothing remembered yet.';
    list.replaceChildren(li);
    return;
  }
  list.replaceChildren(
    ...body.memories.map((m) => {
      const li = document.createElement('li');
      li.dataset.memoryId = m.memory_id;
      const fact = document.createElement('span');
      fact.className = 'fact';
      fact.textContent = m.fact;
      const remove = document.createElement('button');
      remove.type = 'button';
      remove.className = 'delete-memory';
      remove.textContent = 'Delete';
      remove.addEventListener('click', () => memoryCall(`/v1/user/memory/${encodeURIComponent(m.memory_id)}`,
        { method: 'DELETE' }));
      li.append(fact, remove);
      return li;
    }),
  );
}

async function memoryCall(path, options) {
  try {
    await api(path, options);
  } catch (err) {
    $('memory-error').textContent = err.message;
    $('memory-error').hidden = false;
    return;
  }
  await renderMemory();
}

// -- the key -----------------------------------------------------------------------------------

let keyWaiters = [];

/** Show the key dialog; resolves once a key is saved. */
function askForKey(error) {
  const dialog = $('key-dialog');
  $('key-error').hidden = !error;
  $('key-error').textContent = error || '';
  $('key-input').value = '';
  if (!dialog.open) dialog.showModal();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function setUpKeyDialog() {
  const dialog = $('key-dialog');
  $('key-form').addEventListener('submit', () => {
    const key = $('key-input').value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
  });
  dialog.addEventListener('close', () => {
    if (!apiKey()) {
      dialog.showModal(); // nothing works without a key
      return;
    }
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
    loadAll();
  });
  // Escape may close the dialog only when a key is already stored.
  dialog.addEventListener('cancel', (event) => {
    if (!apiKey()) event.preventDefault();
  });
}

// -- start -------------------------------------------------------------------------------------

async function loadAll() {
  try {
    const models = await apiJson('/v1/models');
    state.model = models.data.length ? models.data[0].id : null;
    // The built-in code tool, offered to the model when a replica can run code (else the
    // server says why, and the page leaves it out).
    const code = models.data.length ? models.data[0].code_interpreter : null;
    $('code-tool').disabled = !code?.available;
    $('code-tool').parentElement.title = code?.available
      ? "Let the model run Python code in the server's sandbox"
      : `Code execution is off: ${code?.reason || 'no model'}`;
    $('model-name').textContent = state.model || 'no model available';
    if (state.model && !state.current) showStatus(null);
  } catch (err) {
    $('model-name').textContent = `models: ${err.message}`;
  }
  // The conversation the URL names (a reload, a link), once: a later loadAll (a new key...)
  // leaves the one on screen alone.
  const inUrl = conversationInUrl();
  if (inUrl && !state.conversationId && !state.current) openConversation(inUrl, { fromUrl: true });
  await refreshConversations();
}

function main() {
  setUpKeyDialog();
  showEmpty();

  const maxTokensInput = $('max-tokens');
  maxTokensInput.value = localStorage.getItem(MAX_TOKENS_STORAGE) || '';
  maxTokensInput.addEventListener('change', () => localStorage.setItem(MAX_TOKENS_STORAGE, maxTokensInput.value));
  const codeTool = $('code-tool');
  codeTool.checked = localStorage.getItem(CODE_TOOL_STORAGE) === '1';
  codeTool.addEventListener('change', () => localStorage.setItem(CODE_TOOL_STORAGE, codeTool.checked ? '1' : '0'));

  $('composer').addEventListener('submit', (event) => {
    event.preventDefault();
    trySend();
  });
  $('prompt').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $('composer').requestSubmit();
    }
  });
  $('stop').addEventListener('click', () => state.current && state.current.stop());
  $('new-chat').addEventListener('click', () => newChat());
  window.addEventListener('hashchange', followUrl);
  $('change-key').addEventListener('click', () => askForKey());
  $('attach').addEventListener('click', () => $('file-input').click());
  $('file-input').addEventListener('change', (event) => {
    for (const file of event.target.files) attachFile(file);
    event.target.value = '';
  });
  $('memory-button').addEventListener('click', openMemory);
  $('memory-clear').addEventListener('click', () => memoryCall('/v1/user/memory', { method: 'DELETE' }));
  $('memory-enabled').addEventListener('change', (event) => memoryCall('/v1/user/memory/settings',
    { method: 'PUT', body: { enabled: event.target.checked } }));

  if (apiKey()) loadAll();
  else askForKey(); // first visit: loadAll runs once the key is saved
}

main();
