"""Secrets in the config are never shown: /state, check-config and anything else that prints the
effective config (``describe``) show "<redacted>" in their place.

A key is a secret by its name (``api_key``, ``token``, ``hf_token``, ``*_password``, ``*_secret``,
``credentials``, ``auth``, ``authorization``), in any table and at any depth, so a vLLM option that
passes through [server] or [engine] is covered too; a true or false under such a name is a switch
(vLLM's ``allow_credentials``), shown as it is. A URL's user and password
(``scheme://user:password@host``: a model's address, a kv connector's ``redis://:password@host``)
are a secret under any key, anywhere in a text: the rest of the URL is shown. An unset secret (empty)
is shown as it is: that it is unset is worth seeing, and reveals nothing. A config error never
quotes a secret's value either (``scrub``).
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any

REDACTED = "<redacted>"
_SECRET = re.compile(r"(^|_)(keys?|token|password|passwd|secrets?|credentials?|auth|authorization)$")
"""No plural ``tokens``: vLLM's ``max_num_batched_tokens`` and its like are counts."""
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#\s\"']*)@")
"""A URL's ``user:password@`` (RFC 3986's userinfo), up to the authority's last ``@``: a password
with an ``@`` left unescaped is hidden whole; a quote ends it, as it ends a URL quoted in a message."""


def is_secret(key: str) -> bool:
    return bool(_SECRET.search(key))


def _hidden(key: Any, value: Any) -> bool:
    """``value`` under ``key`` is a set secret (a bool is a switch, never a secret)."""
    return is_secret(str(key)) and bool(value) and not isinstance(value, bool)


def redact_urls(text: str) -> str:
    """``text`` with the user and password of every URL in it replaced by ``REDACTED``."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@" if m["userinfo"] else m[0], text)


def redact(data: Any) -> Any:
    """``data`` (plain dicts and lists) with every set secret replaced by ``REDACTED``, inside a
    JSON object given as text too (a vLLM option such as ``--kv-transfer-config '{...}'``)."""
    if isinstance(data, dict):
        return {k: REDACTED if _hidden(k, v) else redact(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v) for v in data]
    if isinstance(data, str) and (parsed := _json_object(data)) is not None:
        shown = redact(parsed)
        return data if shown == parsed else json.dumps(shown)
    if isinstance(data, str):
        return redact_urls(data)
    return data


def _json_object(text: str) -> dict[str, Any] | None:
    if not text.lstrip().startswith("{"):
        return None
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


SHORTEST_SECRET = 4
"""A set secret shorter than this is left in error messages: it reveals next to nothing, and
hiding every "1" or "on" would garble the messages around it."""


def secret_values(data: Any, hidden: bool = False) -> set[str]:
    """The text of every set secret in ``data`` (a parsed config file): each scalar under a secret
    key at any depth, the user and password of each URL in a text, and inside JSON objects given as
    text."""
    if isinstance(data, dict):
        return {s for k, v in data.items() for s in secret_values(v, hidden or _hidden(k, v))}
    if isinstance(data, list):
        return {s for v in data for s in secret_values(v, hidden)}
    if isinstance(data, str) and not hidden and (parsed := _json_object(data)) is not None:
        return secret_values(parsed)
    text = str(data)
    if hidden:
        return {text} if len(text) >= SHORTEST_SECRET else set()
    found = [m["userinfo"] for m in _USERINFO.finditer(text)] if isinstance(data, str) else []
    found += [u.partition(":")[2] for u in found]  # the password alone, as a message may quote it
    return {u for u in found if len(u) >= SHORTEST_SECRET}


def scrub(messages: list[str], data: Any) -> list[str]:
    """``messages`` (config errors: logged, answered by /reload, printed by check-config) with every
    set secret of ``data`` replaced by ``REDACTED`` where it appears as a whole word, and the user
    and password of any URL they quote."""
    messages = [redact_urls(m) for m in messages]
    secrets = sorted(secret_values(data), key=len, reverse=True)  # a longer secret may hold a shorter
    if not secrets:
        return messages
    pattern = re.compile("|".join(rf"(?<!\w){re.escape(s)}(?!\w)" for s in secrets))
    return [pattern.sub(REDACTED, m) for m in messages]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only ("localhost" or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond this machine
