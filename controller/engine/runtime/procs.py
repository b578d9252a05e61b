"""How the engine's processes start, so that none of them can reach the daemon's signal handlers.

vLLM starts its EngineCore (and its workers, and a data-parallel coordinator) with the multiprocessing
method in ``VLLM_WORKER_MULTIPROC_METHOD`` (``vllm/utils/system_utils.get_mp_context``): ``fork`` by
default on a GPU, ``spawn`` only once CUDA is initialised in the parent; on a CPU the platform always
sets ``spawn`` (``vllm/platforms/cpu.py``). A forked child is a copy of the daemon: it inherits
CPython's signal wakeup fd, which uvloop points at its own self-pipe when the daemon installs its
handlers, and the daemon's handlers themselves. The EngineCore installs its own SIGTERM handler
(``vllm/v1/engine/core.py``), whose C part still writes the signal's number to that inherited pipe:
when vLLM retires the engine with SIGTERM (any restart of a live engine), the daemon reads the byte
and drains as if it had been sent SIGTERM itself, exiting 0, which systemd's ``Restart=on-failure``
does not undo. A forked child that installs no handler (the coordinator) keeps the daemon's no-op
handler and ignores SIGTERM until SIGKILL. A forked child also holds the daemon's listening sockets.

Two defences, each enough for the signals alone:

- ``spawn_engine_processes`` makes vLLM spawn every process (a fresh interpreter that inherits no
  handler, no wakeup fd and only the file descriptors multiprocessing passes it), as it does on a
  CPU and on a GPU once CUDA is initialised, before each build;
- ``forget_daemon_signals_after_fork`` makes any child forked from the daemon all the same (by vLLM
  told otherwise, or by a library) drop the daemon's wakeup fd and return its handlers to the
  default, before the child's own code runs.
"""

from __future__ import annotations

import os
import signal
from collections.abc import MutableMapping

import structlog

log = structlog.get_logger(__name__)

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
"""vLLM's setting of the multiprocessing start method (``vllm/envs.py``), read at each process start."""
START_METHOD = "spawn"

DAEMON_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals the daemon handles (``lifecycle/daemon.py``); a forked child gets the default back."""


def spawn_engine_processes(environ: MutableMapping[str, str] = os.environ) -> None:
    """Have vLLM spawn the engine processes started from now on; an operator's ``fork`` is overridden
    with a warning (as vLLM itself overrides it once CUDA is initialised)."""
    asked = environ.get(START_METHOD_ENV)
    if asked not in (None, START_METHOD):
        log.warning(
            "engine_start_method_overridden",
            asked=asked,
            used=START_METHOD,
            reason="a forked engine process reaches the daemon's signal handlers",
        )
    environ[START_METHOD_ENV] = START_METHOD


def _forget_signals_in_child() -> None:
    """In a child just forked: the daemon's signal wakeup fd and handlers are not the child's."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread (a child of a fork is its own main thread): nothing set
        return
    for sig in DAEMON_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


_registered = False


def forget_daemon_signals_after_fork() -> None:
    """From now on, each child forked from this process starts with no signal wakeup fd and with the
    default action for the daemon's signals. Idempotent: the hook is registered once per process."""
    global _registered
    if not _registered:
        os.register_at_fork(after_in_child=_forget_signals_in_child)
        _registered = True
