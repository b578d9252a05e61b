"""Secrets in the config are never shown: /state, check-config and anything else that prints the
effective config (``describe``) show "<redacted>" in their place.

A key is a secret by its name (``api_key``, ``token``, ``hf_token``, ``*_password``, ``*_secret``),
in any table and at any depth, so a vLLM option that passes through [server] or [engine] is covered
too. An unset secret (empty) is shown as it is: that it is unset is worth seeing, and reveals nothing.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

REDACTED = "<redacted>"
_SECRET = re.compile(r"(^|_)(key|token|password|secret)$")


def is_secret(key: str) -> bool:
    return bool(_SECRET.search(key))


def redact(data: Any) -> Any:
    """``data`` (plain dicts and lists) with every set secret replaced by ``REDACTED``."""
    if isinstance(data, dict):
        return {k: REDACTED if is_secret(str(k)) and v else redact(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only ("localhost" or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond this machine
