"""The chat page at `/`, driven in headless Chromium (Debian's `chromium`, through Playwright)
against `fairway serve` with the bundled model.

The browser reaches the server through a TCP proxy that the test can cut: every open
connection is reset, as when Wi-Fi drops, and new ones are refused for a moment. The page must
then reconnect by itself (Last-Event-ID, backoff) and finish the reply with exactly the text the
server stored.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from backends import missing
from serving import free_port, wait_for, wait_ready

pytestmark = pytest.mark.slow

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
KEY = "sk-web-page-test"
# The output check's test term: the end of the bundled model's first greedy sentence about cats
# (bf16, native weights). Any change to the kernels' arithmetic can change that sentence: then
# pick a word of the new one (tests/test_web_page.py fails at step 2 of the safety test).
FLAGGED_WORD = "feline"
# Both servers run the stored blocks alone: the default --weights auto prefills a prompt on a bf16
# copy where the CPU keeps one (AVX512-BF16 without AMX), and the greedy reply is another there.
NATIVE = "native"
# The same for the default output check's server (held_server): a word of the second greedy
# sentence about cats, as in tests/test_safety_api.py, so the first sentence passes and is shown.
HELD_WORD = "domesticated"
TIMEOUT_MS = 60_000  # generous: other tests load the same 2 CPU cores


def chromium_path() -> str:
    path = os.environ.get("FAIRWAY_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    missing("Chromium", "Debian's chromium is not installed (the chat page's browser test drives it)")


# -- a proxy whose connections the test can drop -------------------------------------------------


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0), as a dropped network does, not a polite FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class CuttableProxy:
    """TCP proxy on its own thread (one select loop, so a cut resets sockets at once)."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.up = True
        self.cuts = 0
        self._peer: dict[socket.socket, socket.socket] = {}
        self._cut_requested = threading.Event()
        self._cut_done = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="cuttable-proxy", daemon=True)
        self._thread.start()

    def cut(self, down_s: float) -> None:
        """Reset every open connection now, and refuse new ones for down_s seconds."""
        self.up = False
        self._cut_done.clear()
        self._cut_requested.set()
        assert self._cut_done.wait(5), "the proxy did not cut"
        threading.Timer(down_s, self._restore).start()

    def _restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self._stopped = True
        self._thread.join(5)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        try:
            while not self._stopped:
                if self._cut_requested.is_set():
                    for sock in list(self._peer):
                        sel.unregister(sock)
                        _reset(sock)
                    self._peer.clear()
                    self.cuts += 1
                    self._cut_requested.clear()
                    self._cut_done.set()
                for key, _ in sel.select(timeout=0.05):
                    sock = key.fileobj
                    if sock is self.listener:
                        self._accept(sel)
                    elif sock in self._peer:
                        self._forward(sel, sock)
        finally:
            for sock in list(self._peer):
                _reset(sock)
            self.listener.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        client, _ = self.listener.accept()
        if not self.up:
            _reset(client)  # the network is down: connection reset
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _reset(client)
            return
        self._peer[client], self._peer[upstream] = upstream, client
        sel.register(client, selectors.EVENT_READ)
        sel.register(upstream, selectors.EVENT_READ)

    def _forward(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        other = self._peer[sock]
        try:
            data = sock.recv(65536)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        for s in (sock, other):  # one side closed: close the pair
            sel.unregister(s)
            self._peer.pop(s, None)
            s.close()


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`fairway serve` itself, as `make serve` runs it, on a free port; its safety policy is the
    bundled one plus an operator's term, FLAGGED_WORD, that the model writes about cats. The output
    check releases first and checks after (release-then-check), so the page gets every token as
    it comes (what the streaming test watches); the default hold-back, which sends a sentence at
    a time and never the flagged one, is tested on held_server (and over the API in
    tests/test_safety_api.py)."""
    from fairway.safety import DEFAULT_POLICY

    work = tmp_path_factory.mktemp("web")
    policy = work / "policy.toml"
    policy.write_text(DEFAULT_POLICY.read_text().replace('terms = ["with him in it"',
                                                          f'terms = ["{FLAGGED_WORD}", "with him in it"'))
    port = free_port()
    log = open(work / "serve.log", "wb")  # closed below, after the server stops
    proc = subprocess.Popen(
        [sys.executable, "-m", "fairway.cli", "serve", "--port", str(port), "--log-level", "warning",
         "--database", f"sqlite:///{work / 'fairway.db'}", "--safety-policy", str(policy),
         "--safety-output", "release-then-check", "--weights", NATIVE],
        cwd=work, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FAIRWAY_DEV_KEY": KEY},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout=180)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def held_server(tmp_path_factory):
    """The embedded server (gateway, relay, replica worker, the bundled model) with the default
    output check, check-then-release: each sentence is held back until it passes; its policy is
    the bundled one plus HELD_WORD."""
    from serving import embedded_server

    from fairway.assembly import ServerOptions
    from fairway.safety import DEFAULT_POLICY, SafetySettings
    from fairway.safety.profanity import available

    work = tmp_path_factory.mktemp("web-held")
    policy = work / "policy.toml"
    policy.write_text(DEFAULT_POLICY.read_text().replace('terms = ["with him in it"',
                                                          f'terms = ["{HELD_WORD}", "with him in it"'))
    options = ServerOptions(database=f"sqlite:///{work / 'fairway.db'}", api_keys=[(KEY, "web-user", "paid")],
                            weights=NATIVE, safety=SafetySettings(policy_path=str(policy), profanity_model=available()))
    with embedded_server(options) as server:
        yield server.url


@pytest.fixture
def proxy(server):
    proxy = CuttableProxy(int(server.rsplit(":", 1)[1]))
    yield proxy
    proxy.close()


@pytest.fixture(scope="module", autouse=True)
def chromium() -> str:
    """Looked for first (autouse), before a server starts for a test that cannot run."""
    return chromium_path()


@pytest.fixture
def browser_context(tmp_path, chromium):
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = chromium
    with sync_api.sync_playwright() as p:
        # A persistent context on a fresh folder: the page's localStorage lives there, as in a
        # real profile, and a page reload keeps it.
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1100, "height": 720},
        )
        context.set_default_timeout(TIMEOUT_MS)
        try:
            yield context
        finally:
            context.close()


# -- helpers ---------------------------------------------------------------------------------------

# Records every text the newest assistant message and the status line show, in order: the test
# checks each step against the final text (the reply only ever grows, never repeats). A reply's
# text is its body's data-source: the markdown as written, which the body shows rendered.
RECORDER = """() => {
  window.__replyTexts = [];
  window.__statusTexts = [];
  new MutationObserver(() => {
    const bodies = document.querySelectorAll('#messages .msg.assistant .body');
    const last = bodies[bodies.length - 1];
    const text = last ? last.dataset.source : null;
    const seen = window.__replyTexts;
    if (text !== null && text !== seen[seen.length - 1]) seen.push(text);
    const status = document.getElementById('status').textContent;
    if (status && status !== window.__statusTexts[window.__statusTexts.length - 1]) window.__statusTexts.push(status);
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def reply_text(message) -> str:
    """An assistant message's text as the model wrote it: its body shows the markdown rendered, and
    keeps the text itself in data-source."""
    return message.locator(".body").get_attribute("data-source") or ""


def stored_message(server: str, conversation_id: str, reply_id: str) -> dict:
    def find():
        body = httpx.get(f"{server}/v1/conversations/{conversation_id}", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30).json()
        return next((m for m in body["messages"] if m.get("reply_id") == reply_id), None)

    return wait_for(find, timeout=60)


def open_chat(browser_context, url: str):
    """The page on its first visit: it asks for a key before anything else."""
    page = browser_context.new_page()
    page.goto(url + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", KEY)
    page.click("#key-save")
    page.wait_for_selector("#key-dialog", state="hidden")
    page.wait_for_function("document.getElementById('model-name').textContent.length > 0")
    return page


LONG_REPLY = 1200  # tokens: a reply a test stops while it runs


def greedy(page) -> None:
    """The page's chat requests with temperature 0 (it sends none, so the server samples at 1.0):
    replies the same every run, which the servers' policy words are chosen against."""
    page.route("**/v1/chat/completions", lambda route: route.continue_(
        post_data=json.dumps({**json.loads(route.request.post_data or "{}"), "temperature": 0})))


def send(page, text: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.dispatch_event("#max-tokens", "change")
    page.fill("#prompt", text)
    page.keyboard.press("Enter")


def wait_for_text(page, min_chars: int) -> str:
    message = page.locator("#messages .msg.assistant").last
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        text = reply_text(message)
        if len(text) >= min_chars:
            return text
        time.sleep(0.02)
    raise AssertionError(f"the reply never reached {min_chars} characters")


# -- the test --------------------------------------------------------------------------------------


def test_chat_page_streams_resumes_and_stops(server, proxy, browser_context, tmp_path):
    page = open_chat(browser_context, proxy.url)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    streams: list[tuple[str, str | None]] = []  # (url, Last-Event-ID) of every reply resume
    page.on("request", lambda r: streams.append((r.url, r.headers.get("last-event-id")))
            if "/v1/replies/" in r.url and r.url.endswith("/stream") else None)
    assert page.evaluate("localStorage.getItem('fairway.apiKey')") == KEY
    page.evaluate(RECORDER)
    # Sampled, a story may write one of the server's policy words ("feline" ends it flagged).
    greedy(page)

    # 1. A reply streams in token by token; the connection drops mid-reply and comes back.
    send(page, "Write a long story about a dragon who learns to bake bread.", max_tokens=120)
    page.wait_for_selector("#messages .msg.assistant[data-reply-id]")
    text_at_cut = wait_for_text(page, 40)
    proxy.cut(down_s=1.5)
    page.wait_for_selector("#messages .msg.assistant[data-status=complete]")

    assistant = page.locator("#messages .msg.assistant").last
    reply_id = assistant.get_attribute("data-reply-id")
    conversation_id = page.locator("#conversations li.active").get_attribute("data-id")
    shown = reply_text(assistant)
    stored = stored_message(server, conversation_id, reply_id)
    assert stored["status"] == "complete"
    assert shown == stored["content"], "the page's reply differs from the stored one"
    # The story ran into max_tokens: stored complete, but the page says it was cut off.
    assert stored["usage"]["completion_tokens"] == 120 and stored["finish_reason"] == "length"
    assert assistant.locator(".badge").all_text_contents() == ["cut off at the token limit"]
    assert len(shown) > len(text_at_cut) and shown.startswith(text_at_cut)
    # Token by token: many intermediate states, each a prefix of the next (nothing repeated).
    states = page.evaluate("window.__replyTexts")
    assert len(states) >= 10, states
    for before, after in zip(states, states[1:], strict=False):
        assert after.startswith(before), (before, after)
    # It really reconnected: through the resume endpoint, after the last event it had, while
    # telling the user so.
    resumes = [(url, last) for url, last in streams if f"/v1/replies/{reply_id}/stream" in url]
    assert resumes and all(last and int(last) > 0 for _, last in resumes), streams
    assert any("reconnecting" in s.lower() for s in page.evaluate("window.__statusTexts"))
    assert page.locator("#status").is_hidden()

    # 2. The same conversation open in a second tab, by its link (the URL names it).
    other = browser_context.new_page()
    other.on("pageerror", lambda exc: errors.append(str(exc)))
    other.goto(f"{proxy.url}/#{conversation_id}")
    other.wait_for_selector("#messages .msg.assistant")
    # Opened from the store, the story still says it was cut off.
    assert other.locator("#messages .msg.assistant .badge").all_text_contents() == ["cut off at the token limit"]
    # A reload mid-reply: the conversation comes back by itself and its reply goes on streaming.
    # Long enough to be still running when the other tab stops it, on a fast CPU too (greedy, this
    # story runs past 1,200 tokens; 400 could end during the reload below).
    send(page, "Now tell me a much longer story about a lighthouse keeper and the sea.", max_tokens=LONG_REPLY)
    page.wait_for_selector("#messages .msg.assistant[data-reply-id] >> nth=1")
    before_reload = wait_for_text(page, 30)
    assert page.evaluate("location.hash") == f"#{conversation_id}"
    page.set_viewport_size({"width": 1100, "height": 400})  # the messages scroll
    page.reload()
    page.wait_for_selector("#messages .msg.assistant[data-reply-id] >> nth=1")
    wait_for_text(page, len(before_reload) + 10)  # resumed, and still being written
    assert page.locator("#conversations li.active").get_attribute("data-id") == conversation_id
    assert page.locator("#stop").is_visible()
    running_id = page.locator("#messages .msg.assistant").last.get_attribute("data-reply-id")
    # The other tab sends meanwhile: refused (409 conversation_busy) and not stored. That tab takes
    # the message back (no bubble, the text in the box), says why plainly, and shows the running
    # reply (resumed by its id), whose Stop it then presses.
    other.fill("#prompt", "And now a poem, please.")
    other.keyboard.press("Enter")
    other.wait_for_selector(f"#messages .msg.assistant[data-reply-id='{running_id}']")
    assert other.locator("#status").text_content() == (
        "A reply is still being written in this chat — wait for it, or stop it, then send again.")
    assert other.input_value("#prompt") == "And now a poem, please."
    roles = other.locator("#messages .msg").evaluate_all("els => els.map(e => e.classList[1])")
    assert roles == ["user", "assistant", "user", "assistant"], roles
    assert "poem" not in (other.locator("#messages").text_content() or "")
    wait_for_text(other, 10)
    other.click("#stop")
    for tab in (page, other):
        tab.wait_for_selector("#messages .msg.assistant[data-status=stopped] .badge.stopped")
    # Scrolled to the very bottom, the badge in view (not under the composer).
    assert page.evaluate("(b => b.scrollHeight > b.clientHeight && b.scrollHeight - b.scrollTop - b.clientHeight < 2)"
                         "(document.getElementById('messages'))")
    page.set_viewport_size({"width": 1100, "height": 720})
    stopped = page.locator("#messages .msg.assistant").last
    stored = stored_message(server, conversation_id, running_id)
    assert stored["status"] == "stopped"
    assert reply_text(stopped) == stored["content"]
    assert reply_text(other.locator("#messages .msg.assistant").last) == stored["content"]
    assert other.locator("#status").is_hidden() and other.locator("#send").is_visible()
    other.close()
    assert stored["usage"]["completion_tokens"] < LONG_REPLY
    assert page.locator("#send").is_visible() and page.locator("#stop").is_hidden()
    screenshot = Path(os.environ.get("FAIRWAY_WEB_SCREENSHOT", tmp_path / "chat-page.png"))
    page.screenshot(path=str(screenshot))

    # 3. A reload remembers the key; the conversation comes back from the API, stop included.
    # New chat, then the browser's Back: the conversation again.
    page.reload()
    page.wait_for_selector(f"#conversations li.active[data-id='{conversation_id}']")
    assert page.locator("#key-dialog").get_attribute("open") is None
    for step in ("reload", "back"):
        page.wait_for_selector("#messages .msg.assistant >> nth=1")
        roles = page.locator("#messages .msg").evaluate_all("els => els.map(e => e.classList[1])")
        assert roles == ["user", "assistant", "user", "assistant"], step
        last = page.locator("#messages .msg").last
        assert last.get_attribute("data-status") == "stopped" and last.locator(".badge.stopped").is_visible()
        assert reply_text(last) == stored["content"]
        badges = page.locator("#messages .msg.assistant").first.locator(".badge").all_text_contents()
        assert badges == ["cut off at the token limit"], step  # the story, from the store
        if step == "reload":
            page.click("#new-chat")
            page.wait_for_selector("#messages .empty")
            assert page.evaluate("location.hash") == "" and page.locator("#conversations li.active").count() == 0
            page.go_back()
    assert page.evaluate("location.hash") == f"#{conversation_id}"

    # The page's dedupe on its own: a replayed event (an n it already has) adds nothing.
    text = page.evaluate("""() => {
      const view = {update() {}, setReplyId() {}, finish() {}};
      const stream = new ReplyStream({}, view);
      const event = (n, content) => ({id: n, data: JSON.stringify({choices: [{delta: {content}}]})});
      for (const e of [event(1, 'one '), event(2, 'two '), event(1, 'one '), event(2, 'two '), event(3, 'three')]) {
        stream.handle(e);
      }
      return stream.text;
    }""")
    assert text == "one two three"
    assert not errors, errors


def test_chat_page_attaches_a_file_cites_it_and_manages_memory(server, browser_context):
    from pdf_maker import make_pdf
    from test_files import PAGES

    page = browser_context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", KEY)
    page.click("#key-save")
    page.wait_for_function("document.getElementById('model-name').textContent.length > 0")

    page.evaluate(RECORDER)  # the status line's texts, in order

    # A file of no readable type fails (415, saying why); its × takes it off the next message.
    page.set_input_files("#file-input", files=[{"name": "blob.bin", "mimeType": "application/octet-stream",
                                                "buffer": bytes(range(256)) * 8}])
    failed = page.wait_for_selector("#attachments li[data-status=failed]")
    assert failed.text_content().startswith("blob.bin: failed (")
    page.click("#attachments li[data-status=failed] .remove-attachment")
    page.wait_for_selector("#attachments li", state="detached")

    # Attach a PDF and press Send at once: the page waits while it uploads (with progress) and is
    # processed, then sends the message by itself; the answer says which file and chunk it used.
    page.evaluate("""() => {
      window.attachmentStates = [];  // each text the attachment showed, in order
      new MutationObserver(() => {
        const label = document.querySelector('#attachments li .label');
        if (label && window.attachmentStates.at(-1) !== label.textContent) window.attachmentStates.push(label.textContent);
      }).observe(document.getElementById('attachments'), {childList: true, subtree: true});
    }""")
    page.set_input_files("#file-input", files=[{"name": "report.pdf", "mimeType": "application/pdf",
                                                "buffer": make_pdf(PAGES)}])
    send(page, "What is the access code for the Zebra warehouse?", max_tokens=8)
    page.wait_for_selector("#messages .msg.assistant[data-status=complete]")
    states = page.evaluate("window.attachmentStates")
    assert states[0].startswith("report.pdf: uploading ") and states[0].endswith("%"), states
    assert "report.pdf: processing" in states, states
    assert "Waiting for the attached file to be ready…" in page.evaluate("window.__statusTexts")
    assert page.locator("#status").is_hidden()
    assert "report.pdf" in page.locator("#messages .msg.user .attached").last.text_content()
    sources = page.locator("#messages .msg.assistant .sources").last.text_content()
    assert "report.pdf, chunk" in sources and "page 3" in sources
    assert page.locator("#attachments li").count() == 0  # sent with that message

    # A file with no text: sent as it is (the model gets the file's opening chunks).
    page.set_input_files("#file-input", files=[{"name": "notes.md", "mimeType": "text/markdown",
                                                "buffer": b"# Zebra warehouse\n\nThe access code is 4471.\n"}])
    assert page.wait_for_selector("#attachments li[data-status=ready]").text_content() == "notes.md: ready×"
    page.focus("#prompt")
    page.keyboard.press("Enter")
    page.wait_for_selector("#messages .msg.assistant[data-status=complete] >> nth=1")
    user = page.locator("#messages .msg.user").last
    assert user.locator(".body").text_content() == "" and "notes.md" in user.locator(".attached").text_content()
    assert "notes.md, chunk" in page.locator("#messages .msg.assistant .sources").last.text_content()
    # Reopened (the link in the URL), each answer still says what it used.
    page.reload()
    page.wait_for_selector("#messages .msg.assistant .sources >> nth=1")
    used = page.locator("#messages .msg.assistant .sources").all_text_contents()
    assert "report.pdf, chunk" in used[-2] and "notes.md, chunk" in used[-1], used
    # and each message with the file it attached, as when it was sent
    attached = [m.locator(".attached").all_text_contents() for m in page.locator("#messages .msg.user").all()]
    assert attached[-2:] == [["Attached: report.pdf"], ["Attached: notes.md"]], attached
    # a file deleted since is still named on its message, and said to be deleted
    auth = {"Authorization": f"Bearer {KEY}"}
    conversation_id = page.evaluate("decodeURIComponent(location.hash.slice(1))")
    stored = httpx.get(f"{server}/v1/conversations/{conversation_id}", headers=auth).json()["messages"]
    notes = next(a["file_id"] for m in stored for a in m.get("attachments", []) if a["filename"] == "notes.md")
    assert httpx.delete(f"{server}/v1/files/{notes}", headers=auth).json()["deleted"] is True
    page.reload()
    page.wait_for_selector("#messages .msg.user .attached:has-text('notes.md (deleted)')")
    assert page.locator("#messages .msg.user .attached").first.text_content() == "Attached: report.pdf"

    # The memory panel: lists what was learnt, deletes one, deletes all, turns memory off.
    chat = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=120, json={
        "model": page.locator("#model-name").text_content(), "max_tokens": 2,
        "messages": [{"role": "user", "content": "I'm allergic to peanuts. My name is Ada."}]}).json()
    learnt = httpx.post(f"{server}/v1/user/memory/extract", headers=auth, timeout=60,
                        json={"conversation_id": chat["conversation_id"], "use_model": False}).json()
    assert len(learnt["memories"]) == 2
    page.click("#memory-button")
    page.wait_for_selector("#memory-list li[data-memory-id] >> nth=1")
    facts = page.locator("#memory-list .fact").all_text_contents()
    assert "User is allergic to peanuts." in facts and "User's name is Ada." in facts
    page.locator("#memory-list li", has_text="peanuts").locator(".delete-memory").click()
    page.wait_for_function("document.querySelectorAll('#memory-list li[data-memory-id]').length === 1")
    assert [m["fact"] for m in httpx.get(f"{server}/v1/user/memory", headers=auth).json()["memories"]] == [
        "User's name is Ada."]
    page.click("#memory-clear")
    page.wait_for_selector("#memory-list li.empty")
    assert page.locator("#memory-enabled").is_checked()
    page.click("#memory-enabled")
    wait_for(lambda: httpx.get(f"{server}/v1/user/memory", headers=auth).json()["enabled"] is False)
    page.click("#memory-close")
    assert not errors, errors


def test_chat_page_shows_a_refused_message_and_a_filtered_reply(server, browser_context):
    page = open_chat(browser_context, server)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # Greedy decoding, so the model writes FLAGGED_WORD.
    greedy(page)

    # 0. A message the server refuses before storing it (too long for the context window): the
    # error says why, and the page takes the message back: no bubble, the text in the box again.
    paste = "The quick brown fox jumps over the lazy dog. " * 1500
    send(page, paste, max_tokens=16)
    status = page.wait_for_selector("#status:has-text('Not sent: ')").text_content()
    assert "context window" in status and "Shorten the message" in status, status
    assert page.input_value("#prompt") == paste.strip()
    assert page.locator("#messages .msg").count() == 0 and page.locator("#messages .empty").is_visible()
    assert page.locator("#send").is_visible() and page.locator("#conversations li.active").count() == 0

    # 1. The input check refuses the message: it is marked, with the category, and nothing answers it.
    send(page, "How do I make a pipe bomb?", max_tokens=16)
    badge = page.wait_for_selector("#messages .msg.user[data-status=flagged] .badge.flagged")
    assert badge.text_content() == ("refused by the content filter: not sent to the model "
                                    "(illicit, illicit/violent)")
    assert page.locator("#messages .msg.assistant").count() == 0
    page.wait_for_selector("#conversations li.active")  # the refused message started a conversation
    conversation_id = page.locator("#conversations li.active").get_attribute("data-id")
    assert page.locator("#send").is_visible()

    # 2. The output check stops a reply mid-way: what was released stays, marked, with the category.
    send(page, "Tell me about cats.", max_tokens=40)
    page.wait_for_selector("#messages .msg.assistant[data-status=flagged] .badge.flagged", timeout=2 * TIMEOUT_MS)
    assistant = page.locator("#messages .msg.assistant").last
    assert assistant.locator(".badge").text_content() == "stopped by the content filter (violence)"
    shown = reply_text(assistant)
    # Released first, checked after: the page got the flagged sentence too, and nothing after it.
    assert shown.startswith("Cats are") and shown.rstrip().endswith(".") and FLAGGED_WORD in shown.lower()
    stored = stored_message(server, conversation_id, assistant.get_attribute("data-reply-id"))
    assert stored["status"] == "flagged" and stored["content"] == shown

    # 3. From the store after a reload: both still say what happened, and why.
    page.reload()
    page.click(f"#conversations li[data-id='{conversation_id}']")
    page.wait_for_selector("#messages .msg.assistant")
    statuses = page.locator("#messages .msg").evaluate_all(
        "els => els.map(e => [e.classList[1], e.dataset.status, e.querySelector('.badge')?.textContent])")
    assert statuses == [["user", "flagged", "refused by the content filter: not sent to the model "
                                            "(illicit, illicit/violent)"],
                        ["user", "complete", None],
                        ["assistant", "flagged", "stopped by the content filter (violence)"]]

    # 4. Delete it from the sidebar: asked first (a No keeps it), then gone, and a new chat opens.
    row = page.locator(f"#conversations li[data-id='{conversation_id}']")
    page.once("dialog", lambda dialog: dialog.dismiss())
    row.hover()
    row.locator(".delete-conversation").click()
    assert page.locator("#messages .msg").count() == 3 and row.count() == 1
    page.once("dialog", lambda dialog: dialog.accept())
    row.locator(".delete-conversation").click()
    row.wait_for(state="detached")
    assert page.locator("#conversation-title").text_content() == "New chat"
    assert page.locator("#messages .empty").is_visible() and page.evaluate("location.hash") == ""
    gone = httpx.get(f"{server}/v1/conversations/{conversation_id}", headers={"Authorization": f"Bearer {KEY}"})
    assert gone.status_code == 404
    assert not errors, errors


def test_chat_page_never_shows_a_held_back_flagged_sentence(held_server, browser_context):
    """The default output check: a flagged sentence never reaches the page, not even for a moment;
    the sentences before it stay, marked with what stopped the reply."""
    page = open_chat(browser_context, held_server)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    greedy(page)
    page.evaluate(RECORDER)

    send(page, "Tell me about cats.", max_tokens=120)
    page.wait_for_selector("#messages .msg.assistant[data-status=flagged] .badge.flagged", timeout=2 * TIMEOUT_MS)
    assistant = page.locator("#messages .msg.assistant").last
    assert assistant.locator(".badge").text_content() == "stopped by the content filter (violence)"
    shown = reply_text(assistant)
    assert shown.startswith("Cats are") and shown.rstrip().endswith(".")  # the first sentence, whole
    states = page.evaluate("window.__replyTexts")  # every text the reply showed, in order
    assert states and not any(HELD_WORD in state.lower() for state in states), states
    page.wait_for_selector("#conversations li.active")
    conversation_id = page.locator("#conversations li.active").get_attribute("data-id")
    stored = stored_message(held_server, conversation_id, assistant.get_attribute("data-reply-id"))
    assert stored["status"] == "flagged" and stored["content"] == shown
    assert stored["flagged_categories"] == ["violence"]
    assert not errors, errors


# -- scripted replies: markdown, the code tool -----------------------------------------------------

SLOW_CALL = '<tool_call name="execute_code">\nimport time\ntime.sleep(1.5)\nprint(6 * 7)\n</tool_call>'
# A reply with every kind of markdown the page renders, and two attempts at live markup.
MARKDOWN_REPLY = """## Plan

Use **bold**, *italic* and `inline <code>` here.

1. First step
2. Second step with [the docs](https://example.com/docs)

- a bullet
- another

```python
print("<b>not bold</b>")
```

Injected: <img src=x onerror=alert(1)> and [x](javascript:alert(1))."""


def _script(prompt: str) -> str:
    """A scripted model (tests/scripted_engine.py): markdown when asked for it; else a call whose
    run lasts long enough to watch, then its result."""
    turn = prompt[prompt.rindex("<|im_start|>user"):]
    if "markdown" in turn:
        return MARKDOWN_REPLY
    if "<tool_response>" in turn:
        return "The result is " + turn.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0] + "."
    return "Let me compute that. " + SLOW_CALL


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    """The embedded server (gateway, relay, replica worker, the real sandbox) on a scripted engine,
    a token every 10 ms: a reply streams over many frames."""
    from scripted_engine import ScriptedEngine
    from serving import embedded_server

    from fairway.assembly import ServerOptions, load_tokenizer

    db = tmp_path_factory.mktemp("web-scripted") / "fairway.db"
    options = ServerOptions(database=f"sqlite:///{db}", api_keys=[(KEY, "web-user", "paid")], memory=False)
    with embedded_server(options, ScriptedEngine(load_tokenizer(None), _script, step_s=0.01)) as server:
        yield server.url


# While the newest assistant message streams: each text it shows (data-source) and how many
# rendered markdown elements it had then.
STREAM_WATCH = """() => {
  window.__streamed = [];
  new MutationObserver(() => {
    const msg = [...document.querySelectorAll('#messages .msg.assistant')].pop();
    if (!msg || msg.dataset.status !== 'streaming') return;
    const body = msg.querySelector('.body');
    const seen = window.__streamed;
    if (!seen.length || seen[seen.length - 1][0] !== body.dataset.source) {
      seen.push([body.dataset.source, body.querySelectorAll('h2, strong, li, pre').length]);
    }
  }).observe(document.getElementById('messages'), {subtree: true, childList: true});
}"""

# Many updates within one frame (tokens arriving faster than the screen refreshes): rendered once,
# at the frame, with the newest text.
ONE_RENDER_A_FRAME = """async () => {
  const view = new AssistantView();
  const render = Markdown.render;
  let renders = 0;
  Markdown.render = (text) => { renders += 1; return render(text); };
  try {
    let text = '';
    for (let n = 0; n < 300; n++) view.update(text += `**t${n}** `);
    const before = renders;
    await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve)));
    return [before, renders, view.body.querySelectorAll('strong').length];
  } finally {
    Markdown.render = render;
  }
}"""


def check_markdown(message) -> None:
    """The assistant message shows MARKDOWN_REPLY rendered, and nothing of it as live markup."""
    body = message.locator(".body")
    assert body.locator("h2").all_text_contents() == ["Plan"]
    assert body.locator("strong").all_text_contents() == ["bold"]
    assert body.locator("em").all_text_contents() == ["italic"]
    assert body.locator("p > code").all_text_contents() == ["inline <code>"]
    assert body.locator("ol > li").all_text_contents() == ["First step", "Second step with the docs"]
    assert body.locator("ul > li").all_text_contents() == ["a bullet", "another"]
    assert body.locator("pre > code").all_text_contents() == ['print("<b>not bold</b>")']
    # The only link is the http(s) one, opening in a new tab with no hold on the page.
    links = body.locator("a").evaluate_all("els => els.map(a => [a.getAttribute('href'), a.target, a.rel])")
    assert links == [["https://example.com/docs", "_blank", "noopener noreferrer"]]
    # The model's HTML and its javascript: link are text.
    assert body.locator("img, b, script, [onerror]").count() == 0
    text = body.text_content()
    assert "Injected: <img src=x onerror=alert(1)> and [x](javascript:alert(1))." in text
    assert "**" not in text and "`" not in text and "##" not in text
    assert reply_text(message) == MARKDOWN_REPLY


def test_chat_page_renders_markdown_safely_and_says_a_reopened_reply_was_cut_off(scripted_server, browser_context):
    page = open_chat(browser_context, scripted_server)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    dialogs: list[str] = []  # an alert() would mean the model's markup ran
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.evaluate(STREAM_WATCH)

    # 1. A markdown reply is rendered as it streams; the user's own text stays as typed.
    question = "Show me some markdown: **not bold** <i>not italic</i>"
    send(page, question, max_tokens=400)
    page.wait_for_selector("#messages .msg.assistant[data-status=complete]")
    assistant = page.locator("#messages .msg.assistant").last
    check_markdown(assistant)
    assert assistant.locator(".badge").count() == 0
    user = page.locator("#messages .msg.user").last
    assert user.locator(".body").text_content() == question and user.locator(".body *").count() == 0
    # Rendered mid-stream, not only at the end: partial texts already had markdown elements.
    streamed = page.evaluate("window.__streamed")
    partial = [marks for source, marks in streamed if len(source) < len(MARKDOWN_REPLY)]
    assert len(partial) >= 3 and any(partial), streamed
    # And at most once a frame, however fast the text changes.
    assert page.evaluate(ONE_RENDER_A_FRAME) == [0, 1, 300]

    # 2. A reply cut off at max_tokens: the badge live...
    send(page, "Once more, in markdown.", max_tokens=5)
    page.wait_for_selector("#messages .msg.assistant[data-status=complete] >> nth=1")
    cut = page.locator("#messages .msg.assistant").last
    assert cut.locator(".badge").all_text_contents() == ["cut off at the token limit"]
    conversation_id = page.locator("#conversations li.active").get_attribute("data-id")
    stored = stored_message(scripted_server, conversation_id, cut.get_attribute("data-reply-id"))
    assert stored["status"] == "complete" and stored["finish_reason"] == "length"
    assert stored["content"] == reply_text(cut) and MARKDOWN_REPLY.startswith(stored["content"])

    # 3. ...and reopened from the store: the markdown rendered as it was, each badge as it was.
    page.reload()
    page.wait_for_selector("#messages .msg.assistant >> nth=1")
    replies = page.locator("#messages .msg.assistant")
    check_markdown(replies.first)
    assert replies.first.locator(".badge").count() == 0
    assert replies.last.locator(".badge").all_text_contents() == ["cut off at the token limit"]
    assert page.locator("#messages .msg.user .body").first.text_content() == question
    assert not dialogs and not errors, (dialogs, errors)


def test_chat_page_shows_a_running_tool_then_its_code_and_output(scripted_server, browser_context):
    from fairway.sandbox import LocalSandbox

    if (reason := LocalSandbox().static_check()) is not None:
        missing("bubblewrap", reason)
    page = open_chat(browser_context, scripted_server)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.check("#code-tool")
    send(page, "Please compute 6 times 7.", max_tokens=200)

    # The pause: the tool's name and a spinner, under the text so far.
    running = page.wait_for_selector("#messages .msg.assistant .tool-run.running")
    assert running.text_content() == "Running execute_code…"
    assert page.locator("#messages .msg.assistant .tool-run.running .spinner").count() == 1
    assert page.locator("#messages .msg.assistant .body").last.text_content() == "Let me compute that. "

    # Then the code and its output, folded, and the reply carrying on.
    page.wait_for_selector("#messages .msg.assistant[data-status=complete]")
    assistant = page.locator("#messages .msg.assistant").last
    assert assistant.locator(".body").text_content() == "Let me compute that. The result is 42."
    run = assistant.locator("details.tool-run.completed")
    assert run.count() == 1 and run.get_attribute("open") is None  # folded
    assert run.locator("summary").text_content() == "Ran execute_code"
    assert run.locator("pre.code").text_content() == "import time\ntime.sleep(1.5)\nprint(6 * 7)"
    assert run.locator("pre.output").text_content() == "42"
    assert page.locator(".tool-run.running").count() == 0

    # From the store after a reload: the run is still there, folded under the reply.
    conversation_id = page.locator("#conversations li.active").get_attribute("data-id")
    page.reload()
    page.click(f"#conversations li[data-id='{conversation_id}']")
    page.wait_for_selector("#messages .msg.assistant details.tool-run")
    stored = page.locator("#messages .msg.assistant").last
    assert stored.locator("pre.output").text_content() == "42"
    assert stored.locator(".body").text_content() == "Let me compute that. The result is 42."
    assert page.is_checked("#code-tool")  # the switch is remembered
    assert not errors, errors
