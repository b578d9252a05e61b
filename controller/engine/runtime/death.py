"""Why an EngineCore died, as the daemon can tell it: a note the EngineCore writes at its death.

vLLM's EngineCore tells its client only that it died: on a fatal error in its busy loop,
``run_engine_core`` logs the traceback to the EngineCore's own stderr and calls
``EngineCoreProc._send_engine_dead`` from inside its ``except`` block, which sends the bare bytes
``ENGINE_CORE_DEAD`` (``vllm/v1/engine/core.py``); the client raises ``EngineDeadError``, whose
message names no cause, and the process exits 1 whatever the error. A CUDA out-of-memory error
reaches that block as ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried to allocate ...") from
a model run in the EngineCore (one GPU: vLLM's in-process executor), or as the ``RuntimeError``
"Worker failed with error 'CUDA out of memory...'" into which the multiprocess executor turns a
worker's error (``vllm/v1/executor/multiproc_executor.py``); an allocation outside PyTorch's
caching allocator (cuBLAS, NCCL) fails as "CUDA error: out of memory".

So the scheduler module, which vLLM imports inside the EngineCore (``scheduler_cls``), wraps
``_send_engine_dead``: before the bare bytes go, the error being handled (``sys.exc_info``) is
classified here and written as a one-line JSON note into the folder the daemon names in
:data:`ENV`. The daemon reads the notes when its engine is found dead (``DeathNotes``); each new
engine starts with none. Where the note cannot be written (no folder named: ``vllm serve`` from the
same environment) nothing changes. On a CPU no CUDA error occurs and no note says out of memory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping, MutableMapping
from pathlib import Path

ENV = "VLLM_AUTOPILOT_DEATH_NOTES"
"""The folder an EngineCore writes its death note into; set by the daemon before each build."""

CUDA_OOM = "cuda_oom"
"""The note's cause for a CUDA out-of-memory error."""
OTHER = "error"

OOM_MARKERS = ("CUDA out of memory", "CUDA error: out of memory")
"""torch's message for its caching allocator's failure, and CUDA's own (``cudaErrorMemoryAllocation``)
for an allocation outside it; the multiprocess executor carries a worker's in its own error's text."""


def cause_of(exc: BaseException | None) -> str:
    """``CUDA_OOM`` when ``exc`` or an error it was raised from or during is a CUDA out-of-memory
    error (``torch.OutOfMemoryError`` by name, so the daemon need not import torch; else its text),
    else ``OTHER``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ == "OutOfMemoryError" or any(m in str(exc) for m in OOM_MARKERS):
            return CUDA_OOM
        exc = exc.__cause__ or exc.__context__
    return OTHER


def write_note(exc: BaseException | None, environ: Mapping[str, str] = os.environ) -> None:
    """In the EngineCore at its death: the cause of ``exc`` into the daemon's folder, one file per
    process (data-parallel engines each write their own). Never raises: the death message must go."""
    folder = environ.get(ENV)
    if not folder:
        return
    note = {"cause": cause_of(exc), "error": f"{type(exc).__name__}: {exc}"[:2000]}
    try:
        Path(folder, f"{os.getpid()}.json").write_text(json.dumps(note))
    except OSError:
        return


class DeathNotes:
    """The daemon's side: one folder for the notes of the engine in force."""

    def __init__(self, environ: MutableMapping[str, str] = os.environ) -> None:
        self._environ = environ
        self.folder: Path | None = None

    def arm(self) -> None:
        """Before a build: the engine processes started from now on write their notes here."""
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="vllm-autopilot-deaths-"))
            # gone with this object or at exit, where ``close`` never ran (a daemon killed, a test)
            self._remove = weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        self._environ[ENV] = str(self.folder)

    def clear(self) -> None:
        """A new engine is in force: notes left are an older engine's."""
        for note in self.folder.glob("*.json") if self.folder else ():
            note.unlink(missing_ok=True)

    def causes(self) -> list[str]:
        """The causes the engine's processes wrote at their death, if any."""
        found = []
        for note in sorted(self.folder.glob("*.json")) if self.folder else ():
            try:
                found.append(str(json.loads(note.read_text()).get("cause", OTHER)))
            except (OSError, ValueError, AttributeError):
                found.append(OTHER)
        return found

    def close(self) -> None:
        if self.folder is not None:
            self._remove()
            self.folder = None
        self._environ.pop(ENV, None)
