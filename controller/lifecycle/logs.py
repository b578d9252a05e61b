"""Logging set-up: one pipeline, one line per record, for our structlog events and for every stdlib
logger (vLLM's, uvicorn's, aiohttp's, apscheduler's), in the daemon and in vLLM's EngineCore process.

JSON lines when stdout is not a TTY (journald), a console rendering on a TTY. Every record goes to
one root handler whose ``structlog.stdlib.ProcessorFormatter`` renders it; structlog events reach it
through the stdlib logger of the same name.

vLLM 0.32 configures logging not at import but when an engine is built, from its ``LoggingConfig``
(``create_engine_config`` in the daemon) and again at the start of each process it spawns
(``EngineCore.run_engine_core``, workers), from the same config passed along. Its default
installs a text handler on the ``vllm`` logger (``propagate=False``); ``VLLM_CONFIGURE_LOGGING=0``
would skip that, but then the EngineCore process, a fresh interpreter, has no handler at all and
its INFO records (model load, KV cache size, compile times) are lost. So instead
``configure_logging`` points ``VLLM_LOGGING_CONFIG_PATH`` at a ``dictConfig`` that installs this
module's handler on the root logger: vLLM applies it in both processes, which then log alike.
``LoggingConfig`` reads the variable when the engine arguments are turned into a config, so
``configure_logging`` must run before that; the CLI calls it before importing the daemon (and so
vLLM), which also routes vLLM's import-time records through the pipeline.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

HANDLER_NAME = "vllm-autopilot"
# Chatty at INFO: apscheduler logs every control tick.
QUIET_LOGGERS = {"apscheduler": logging.WARNING}
# Loggers whose level is set explicitly rather than inherited from the root: building vLLM's app
# imports model_hosting_container_standards (SageMaker routes), which sets the root logger to ERROR
# at import. vLLM pins its own "vllm" logger (our dictConfig); uvicorn's access log would be lost.
PINNED_LOGGERS = ("controller", "policies", "aiohttp", "uvicorn")

_vllm_config_path: Path | None = None


def _add_process(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> EventDict:
    """Name the process of records not from the daemon's main process (vLLM's EngineCore, workers):
    journald attributes every line of the shared stdout to the daemon."""
    record = event_dict.get("_record")
    if record is not None:
        name = getattr(record, "vllm_process_name", None) or record.processName
        if name != "MainProcess":
            event_dict.setdefault("process", name)
            event_dict.setdefault("pid", record.process)
    return event_dict


def _shared_processors() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]


def make_formatter(json_logs: bool = True) -> logging.Formatter:
    """The formatter of the root handler. Also the ``"()"`` factory of the dictConfig vLLM applies,
    so it must stay importable by name and take only JSON-serialisable arguments."""
    renderer: Processor
    final: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if json_logs:
        final.append(structlog.processors.format_exc_info)  # tracebacks as one string field
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_shared_processors(), _add_process],
        processors=[*final, renderer],
    )


def make_handler(json_logs: bool = True) -> logging.Handler:
    handler = logging.StreamHandler(sys.stdout)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(make_formatter(json_logs))
    return handler


def vllm_logging_config(level: str, json_logs: bool) -> dict[str, Any]:
    """The ``dictConfig`` vLLM applies in the daemon and in each process it spawns: our handler on the
    root, and the ``vllm`` logger propagating to it (its own handler removed)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {HANDLER_NAME: {"()": f"{__name__}.make_formatter", "json_logs": json_logs}},
        "handlers": {
            HANDLER_NAME: {
                "class": "logging.StreamHandler",
                "formatter": HANDLER_NAME,
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {"vllm": {"level": level, "handlers": [], "propagate": True}},
        "root": {"level": level, "handlers": [HANDLER_NAME]},
    }


def _hand_config_to_vllm(level: str, json_logs: bool) -> None:
    global _vllm_config_path
    if os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return  # the operator turned vLLM's logging set-up off: its records still reach our root here
    current = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if current and (_vllm_config_path is None or current != str(_vllm_config_path)):
        return  # the operator's own logging config wins
    if _vllm_config_path is None:
        fd, name = tempfile.mkstemp(prefix="vllm-autopilot-logging-", suffix=".json")
        os.close(fd)
        _vllm_config_path = Path(name)
        atexit.register(_remove_config_file)
    _vllm_config_path.write_text(json.dumps(vllm_logging_config(level, json_logs)))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_vllm_config_path)


def _remove_config_file() -> None:
    if _vllm_config_path is not None:
        with contextlib.suppress(OSError):
            _vllm_config_path.unlink()


def configure_logging(level: str = "INFO", json_logs: bool | None = None) -> None:
    """Set up logging for the daemon and for vLLM's processes. ``json_logs=None``: JSON unless stdout
    is a TTY. Call it before vLLM is imported (see the module docstring); calling it again replaces
    the previous set-up."""
    if json_logs is None:
        json_logs = not sys.stdout.isatty()
    level = level.upper()
    numeric = logging.getLevelNamesMapping()[level]
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(handler)
    root.addHandler(make_handler(json_logs))
    root.setLevel(numeric)
    for name in PINNED_LOGGERS:
        logging.getLogger(name).setLevel(numeric)
    # What the dictConfig does in vLLM's processes, done here at once: vLLM may have set up its own
    # handler in this process already (an engine built before this call, as in tests).
    vllm_logger = logging.getLogger("vllm")
    for handler in list(vllm_logger.handlers):
        vllm_logger.removeHandler(handler)
    vllm_logger.propagate = True
    vllm_logger.setLevel(numeric)
    for name, floor in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(max(numeric, floor))
    structlog.configure(
        processors=[*_shared_processors(), structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    _hand_config_to_vllm(level, json_logs)
