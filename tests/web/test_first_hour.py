"""A new user's first hour, as one check: the README's `voxgate serve` (the embedded voice), the page in
chromium (connect, speak, stop), a backend's session joined from the page and ended by the backend, the
OpenAI bridge example against a stand-in LLM server joined through the address it prints, and the tab
closed mid-session. The server's log holds no traceback at the end (issue 38).

One server, one browser. The backend (the Python client) runs on an asyncio loop in a thread of its own,
since Playwright's sync API keeps this one.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.backend.test_openai_bridge import TOKENS, start_llm
from tests.conftest import ROOT
from tests.test_readme_commands import ReadmeServer
from tests.web.test_page import CHROMIUM, LONG_TEXT, open_page, playwright_sync, wait_event
from voxgate.client import VoxgateSession

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian chromium at /usr/bin/chromium"),
]

# What a server log must never hold after a normal hour of use.
TRACEBACK = re.compile(r"Traceback \(most recent call last\)|Task exception was never retrieved|Exception in callback")


class Background:
    """An asyncio loop in a thread: the backend's side of the conversation."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def browser():
    """Chromium as test_page.py starts it, without its fake microphone's speech (no microphone here)."""
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--allow-loopback-in-peer-connection", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            "--disable-background-networking", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--autoplay-policy=no-user-gesture-required",
        ])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def readme_server():
    server = ReadmeServer()
    yield server
    server.stop()


def wait_log(server, pattern: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = open(server.log_path, encoding="utf-8").read()
        if re.search(pattern, text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the server log:\n{text[-3000:]}")


def row_cells(page, uid: str) -> list[str]:
    return page.eval_on_selector_all(f"#utt-{uid} td", "(tds) => tds.map((td) => td.textContent)")


def test_first_hour(browser, readme_server):
    server = readme_server
    back = Background()
    context = browser.new_context(viewport={"width": 1280, "height": 720}, bypass_csp=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    llm = None
    bridge = None
    try:
        # The page: connect, speak, stop.
        open_page(page, server)
        page.fill("#text", "Hello there.")
        page.click("#speak")
        wait_event(page, "utterance.done", "p1", timeout=30000)
        page.fill("#text", LONG_TEXT)
        page.click("#speak")
        page.wait_for_function("(window.voxgate.metrics.utterances.p2 || {}).audible_ms > 300", timeout=20000)
        page.click("#stop")
        interrupted = wait_event(page, "utterance.interrupted", "p2")["msg"]
        # The row shows what was heard of the text, and the rest struck through.
        page.wait_for_selector("#utt-p2 .unheard")
        assert page.text_content("#utt-p2 .heard") == interrupted["played_text"]
        assert page.text_content("#fig-ttfa-p50").endswith("(2)")
        assert len(page.text_content("#fig-ttfa-recent").split(" · ")) == 2

        # A backend's session, with speech queued before anyone listens, joined from the page.
        backend = VoxgateSession(server.url)
        back.run(backend.open())
        uid = back.run(backend.say("A backend speaks here.", wait=False))
        page.goto(backend.join_url)
        page.click("#connect")
        page.wait_for_function("window.voxgate.state.session === 'ready'", timeout=20000)
        wait_event(page, "utterance.done", uid, timeout=30000)
        page.wait_for_function("(id) => /ms$/.test(document.querySelector(`#utt-${id} td:nth-child(3)`).textContent)",
                               arg=uid)
        cells = row_cells(page, uid)
        assert cells[1] == "done" and cells[5] == "A backend speaks here.", cells
        # The backend ends it (DELETE): a normal end, one line in the log, no error banner.
        back.run(backend.end())
        page.wait_for_function("window.voxgate.state.session === 'closed'", timeout=10000)
        assert page.is_hidden("#error")
        ends = page.evaluate("window.voxgate.events.filter((e) => e.dir === 'page').map((e) => e.msg.type)")
        assert ends == ["session ended: ended through the session API"], ends
        back.run(backend.close())

        # The bridge example against a stand-in LLM server, joined through the address it prints.
        llm, llm_url = back.run(start_llm([]))
        bridge = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "examples", "openai_bridge.py"), "--gateway", server.url,
             "--llm-url", llm_url, "--model", "stand-in-model"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        bridge.stdin.write("When does the store open?\n")
        bridge.stdin.flush()
        first = bridge.stdout.readline()
        join = next(word for word in first.split() if word.startswith(server.url + "/?"))
        page.goto(join)
        page.click("#connect")
        reply = wait_event(page, "utterance.done", timeout=30000)["msg"]
        assert reply["text"] == "".join(TOKENS)

        # Close the tab while connected: the page ends its connection as it goes (pagehide), so the
        # server logs the end at once, in a line; otherwise it waits ~30 s for ICE consent to fail.
        session_id = page.evaluate("window.voxgate.state.session_id")
        page.close()
        wait_log(server, rf"session {session_id}: connection closed", timeout=10)
        bridge.stdin.close()
        assert bridge.wait(30) == 0, bridge.stderr.read()[-2000:]
        assert errors == []
        log = open(server.log_path, encoding="utf-8").read()
        assert not TRACEBACK.search(log), log[-4000:]
    finally:
        if bridge is not None and bridge.poll() is None:
            bridge.kill()
        if llm is not None:
            back.run(llm.cleanup())
        back.stop()
        context.close()
