"""The bundled page works under its own Content-Security-Policy (finding 17).

The server sends a strict CSP (own scripts, styles and connections only, no
eval, no framing). Debian's chromium loads the page with that policy
enforced, connects, speaks, and must report no CSP violation.
"""

from __future__ import annotations

import os

import pytest

playwright_sync = pytest.importorskip("playwright.sync_api")

CHROMIUM = "/usr/bin/chromium"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian chromium at /usr/bin/chromium"),
]


def test_the_page_connects_and_speaks_under_its_csp(tone_server):
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--allow-loopback-in-peer-connection", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking", "--autoplay-policy=no-user-gesture-required"],
        )
        try:
            page = browser.new_page()  # the CSP is enforced: no bypass
            messages: list[str] = []
            page.on("console", lambda m: messages.append(m.text))
            page.on("pageerror", lambda exc: messages.append(str(exc)))
            response = page.goto(tone_server.url + "/")
            assert "default-src 'self'" in response.headers["content-security-policy"]
            page.click("#connect")
            page.wait_for_selector("#speak:not([disabled])", timeout=20000)
            page.fill("#text", "Hi.")
            page.click("#speak")
            page.wait_for_selector("#log li.in b:text-is('utterance.done')", timeout=20000)
            violations = [m for m in messages if "Content Security Policy" in m or "Content-Security-Policy" in m]
            assert violations == [], violations
        finally:
            browser.close()
