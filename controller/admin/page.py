"""The status page at ``GET /`` of the control plane: one self-contained HTML file
(``static/status.html``: its script inline, its charts hand-drawn SVG, nothing fetched from outside)
that polls ``/state`` every second and ``/metrics`` every few.

The page itself is served without the admin token: it is a static file that holds no data. What it
shows comes from ``/state``, which keeps its bearer token; the page asks for the token (or takes it
from the URL fragment ``#token=...``, which browsers never send, so it reaches no log) and keeps it in
the tab's session storage. A Content-Security-Policy pins the inline script by its hash and lets the
page connect to its own origin only.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import re

from aiohttp import web

_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


@functools.cache
def page() -> tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy (read once: the file ships with the package)."""
    html = (importlib.resources.files("controller.admin") / "static" / "status.html").read_text("utf-8")
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(m.encode()).digest()).decode() + "'"
        for m in _SCRIPT.findall(html)
    )
    csp = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html.encode("utf-8"), csp


async def status_page(_request: web.Request) -> web.Response:
    body, csp = page()
    headers = {
        "Content-Security-Policy": csp,
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    return web.Response(body=body, content_type="text/html", charset="utf-8", headers=headers)


async def favicon(_request: web.Request) -> web.Response:
    """No icon, said so: a browser asks for ``/favicon.ico`` beside every page, and a 404 there is an
    error in the page's console. (The page cannot name an icon itself: its CSP and its no-outside-
    fetch rule leave no ``<link>``.)"""
    return web.Response(status=204, headers={"Cache-Control": "max-age=86400"})
