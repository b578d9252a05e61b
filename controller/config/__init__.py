"""config.toml: one typed table per TOML table, parsed and validated at once; the reload diff.

``config.toml``: one frozen dataclass per TOML table, parsed and validated at once (``load.py``), errors
that name the key, the value and the fix (an unknown key: the nearest known one, or the list);
``classes_table.py`` (``[admission.classes.NAME]`` checked and ordered into the gate's classes),
``slo_table.py`` (the optional ``[slo]`` table resolved per class into
``policies/slo_targets.SloTargets``, and the ``[control] cost_profile`` check), ``fields.py`` (``Key``:
how a table's key documents and checks itself, through ``policies/common.py``'s checks, the ones
constructor parameters pass; a non-finite number is refused everywhere), ``checks.py`` (the
cross-table, vLLM-parser and policy checks; the policy is built as the daemon builds it,
``ControlConfig.build_policy``, the one construction of a policy from the tables); the reload diff
(``diff.py``: what is live, what waits for an engine restart); ``secrets.py`` (what is never shown:
secrets, by their key's name and a URL's user and password under any key, redacted wherever the config is
printed, inside JSON text options too, and scrubbed from error messages; the loopback check);
``cli_layer.py`` (``serve [MODEL] [vllm serve options]`` laid over the TOML file: command line > YAML >
TOML > defaults, kept as ``Config.overlay`` so a reload lays it over the file again). May import
``admission/classes`` (the classes ``[admission.classes]`` builds), ``policies/`` (the checks of a value,
the policy) and, lazily, ``engine/runtime/args`` (vLLM's own argument names, and
``engine/runtime/serve_args``: the serve command line) and ``profiles/`` (a named cost profile must
load). Invariant: a ``Config`` is either wholly valid or not built.
"""
