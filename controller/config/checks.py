"""The checks ``parse_config`` (``load.py``) runs once every table checked its own keys: the free
``[server]`` keys against vLLM's parser, the keys that are valid alone and wrong together, and the
policy built with its parameters. Each returns its errors, naming the key, the value and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

from controller.config.secrets import is_loopback
from policies.base import PolicyError, UnknownParameter
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


TABLE_KEYS_OF = ("control", "admission")
"""The tables whose keys a file may set under ``[control.params]`` by mistake: the normalize stage's
and the gate's settings, which hold for every policy."""


def policy_errors(engine: dict[str, Any], tables: dict[str, Any], slo: SloTargets | None) -> list[str]:
    """``[control] policy`` must build with its ``[control.params]``, as the daemon builds it."""
    control = tables["control"]
    try:
        control.build_policy(tables["admission"], slo, engine["max_num_seqs"])
    except UnknownParameter as exc:
        keys = {
            t: {f.name for f in dataclasses.fields(tables[t])} - {"params", "classes"} for t in TABLE_KEYS_OF
        }
        table = next((t for t in TABLE_KEYS_OF if exc.key in keys[t]), None)
        if table is None:
            return [f"[control] policy = {control.policy!r}: {exc}"]
        return [
            f"[control.params] {exc.key} is not a parameter of policy {control.policy!r} but a key of "
            f"[{table}], for every policy: write it in [{table}]"
        ]
    except PolicyError as exc:
        return [f"[control] policy = {control.policy!r}: {exc}"]
    return []


def kv_floor_need(engine: dict[str, Any], folder: Path) -> int | None:
    """Bytes of one ``max_model_len`` sequence of the model's KV cache, where [engine] sets
    kv_cache_memory_bytes and the model's ``config.json`` is here (``kv_floor_errors``); else None."""
    if not engine.get("kv_cache_memory_bytes"):
        return None
    shape = kv_shape(engine, folder)
    return None if shape is None else shape[0] * shape[1]


def kv_floor_errors(engine: dict[str, Any], guard: Any, folder: Path) -> list[str]:
    """[guard] min_kv_cache_memory_bytes must hold one ``max_model_len`` sequence of the model's KV
    cache: vLLM refuses to build a smaller one, so a memory restart down to the floor would fail each
    time. Checked where [engine] sets kv_cache_memory_bytes (the knob the guard moves then) and the
    model's ``config.json`` is on this machine (a folder, or the Hugging Face cache: no download at
    load); the bytes a token takes are a lower bound (2 a value, 1 for an fp8 KV cache, 4 in
    float32), so a file that passes may still be short, never the other way round."""
    if not engine.get("kv_cache_memory_bytes"):
        return []
    shape = kv_shape(engine, folder)
    if shape is None:
        return []
    per_token, max_len = shape
    need, floor = per_token * max_len, int(guard.min_kv_cache_memory_bytes)
    if floor >= need:
        return []
    return [
        f"[guard] min_kv_cache_memory_bytes = {floor}: below one max_model_len sequence of the model's KV "
        f"cache ({max_len} tokens x {per_token} bytes = {need} bytes), which vLLM refuses to build, so a "
        f"memory restart down to it would fail; raise it to at least {need}, or lower [engine] max_model_len"
    ]


_NOT_FULL_ATTENTION = (
    "sliding_window",
    "layer_types",
    "kv_lora_rank",
    "attention_chunk_size",
    "layers_block_type",
)
"""config.json keys of models whose KV cache is not one full-attention entry per layer and token
(windows, MLA, hybrid layers): they need less, and are not checked."""


def kv_shape(engine: dict[str, Any], folder: Path) -> tuple[int, int] | None:
    """(KV bytes a token takes at least, max_model_len) from the model's local ``config.json``; None
    where it cannot be read or its attention is not plain full attention."""
    cfg = _model_config(str(engine.get("model", "")), engine.get("revision"), folder)
    if cfg is None:
        return None
    text = cfg.get("text_config") or cfg
    if any(text.get(key) for key in _NOT_FULL_ATTENTION):
        return None
    try:
        layers, heads = int(text["num_hidden_layers"]), int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        max_len = int(engine.get("max_model_len") or text["max_position_embeddings"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if str(engine.get("kv_cache_dtype", "auto")).startswith("fp8"):
        value_bytes = 1
    elif str(engine.get("dtype", "auto")) in ("float32", "float"):
        value_bytes = 4
    else:
        value_bytes = 2
    return 2 * layers * kv_heads * head_dim * value_bytes, max_len  # a key and a value per head


def _model_config(model: str, revision: Any, folder: Path) -> dict[str, Any] | None:
    candidates = [Path(model), folder / model]
    found = next((p / "config.json" for p in candidates if (p / "config.json").is_file()), None)
    if found is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json", revision=revision)
        except Exception:  # not a repository id, no cache: nothing to check against
            return None
        found = Path(cached) if isinstance(cached, str) else None
    if found is None:
        return None
    try:
        data = json.loads(found.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
