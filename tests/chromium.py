"""Headless Chromium for the tests, in one place: how it is launched (Debian's
``chromium``, driven by Playwright, never a downloaded browser), a page in a
context of its own, and a page's HTML served from an origin of its own.

``tests/conftest.py``'s ``browser`` fixture launches it; the browser tests
(``sidecar/test_resume_browser.py``, ``sidecar/test_http2_clients.py``,
``sidecar/test_playground.py``, ``compat/clients``) use the rest.
"""

from __future__ import annotations

import contextlib
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Debian's chromium, as root, with nothing reaching for the network (which is closed here).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextlib.contextmanager
def launched() -> Iterator[Any]:
    """A headless Chromium (Playwright's ``Browser``) until the block ends.

    A missing Playwright or browser fails the test, never skips it: a skip would
    hide a broken page. While it lives, Playwright's loop runs in this thread, so
    no ``asyncio.run()`` may run here meanwhile."""
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed in this venv (scripts/setup-venv.sh dev installs it)",
                    pytrace=False)
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.fail("no chromium: install Debian's package (scripts/system-deps.sh chromium); "
                    "a downloaded browser is not used", pytrace=False)
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        except Error as error:
            pytest.fail(f"chromium at {chromium} did not start: {error}", pytrace=False)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def new_page(browser: Any, **context_options: Any) -> Iterator[Any]:
    """A page in a browser context of its own (``context_options`` are
    Playwright's: ``viewport``, ``ignore_https_errors``...), closed with the block."""
    context = browser.new_context(**context_options)
    try:
        yield context.new_page()
    finally:
        context.close()


@contextlib.contextmanager
def served_page(html: bytes) -> Iterator[str]:
    """``html``, answered to every GET by a small HTTP server of the test's own;
    its origin, ``http://127.0.0.1:<port>``.

    The page is then another origin than the sidecar it calls, as a web app is
    to its API: its requests take the CORS path a real deployment's take. (A
    ``data:`` page would have the opaque ``null`` origin instead, which no real
    deployment has.)"""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(html)))
            self.end_headers()
            self.wfile.write(html)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # keep pytest's output for failures

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
