"""The checks ``parse_config`` (``load.py``) runs once every table checked its own keys: the free
``[server]`` keys against vLLM's parser, the keys that are valid alone and wrong together, and the
policy built with its parameters. Each returns its errors, naming the key, the value and the fix."""

from __future__ import annotations

import difflib
from typing import Any

from controller.config.secrets import is_loopback
from policies.base import PolicyError
from policies.slo_targets import SloTargets


def server_option_errors(extra: dict[str, Any], own: list[str]) -> list[str]:
    """vLLM checks the free [server] keys; a near miss of our own keys (prot -> port) says so too,
    since vLLM's parser does not know them."""
    from controller.engine.runtime.args import engine_table_errors  # lazy: imports vLLM (seconds)

    errors: list[str] = []
    for key, value in extra.items():
        close = difflib.get_close_matches(key, own, n=1)
        hint = f"; or did you mean '{close[0]}'?" if close else ""
        errors.extend(problem + hint for problem in engine_table_errors({}, {key: value}))
    return errors


def cross_table_errors(engine: dict[str, Any], tables: dict[str, Any]) -> list[str]:
    """Keys that are valid alone and wrong together (``tables``: each table's dataclass by name)."""
    errors = []
    if tables["server"].port == tables["admin"].port and tables["server"].host == tables["admin"].host:
        errors.append(
            f"[admin] port = {tables['admin'].port}: same as [server] port; "
            "give the control plane its own port"
        )
    admin = tables["admin"]
    if not admin.token and not is_loopback(admin.host):
        errors.append(
            f"[admin] host = {admin.host!r}: the control plane would answer /state and /reload beyond "
            'this machine without a token; set [admin] token, or host = "127.0.0.1"'
        )
    adm = tables["admission"]
    if adm.default_priority < adm.most_urgent_priority:
        errors.append(
            f"[admission] default_priority = {adm.default_priority}: below most_urgent_priority = "
            f"{adm.most_urgent_priority}, so a request naming none would be refused; raise it"
        )
    seqs = engine["max_num_seqs"]
    if not isinstance(seqs, int) or seqs < 1:
        errors.append(f"[engine] max_num_seqs = {seqs!r}: must be an integer >= 1 (it caps the batch)")
    control = tables["control"]
    if isinstance(seqs, int) and 1 <= seqs < control.max_num_active_seqs_min:
        errors.append(
            f"[control] max_num_active_seqs_min = {control.max_num_active_seqs_min}: above [engine] "
            f"max_num_seqs = {seqs}, the batch cap's ceiling; lower it"
        )
    if control.limit_min > control.limit_max:
        errors.append(
            f"[control] limit_min = {control.limit_min}: above limit_max = {control.limit_max}; lower it"
        )
    return errors


def policy_errors(engine: dict[str, Any], tables: dict[str, Any], slo: SloTargets | None) -> list[str]:
    """``[control] policy`` must build with its ``[control.params]``, as the daemon builds it."""
    control = tables["control"]
    try:
        control.build_policy(tables["admission"], slo, engine["max_num_seqs"])
    except PolicyError as exc:
        return [f"[control] policy = {control.policy!r}: {exc}"]
    return []
