"""One engine step's cost figures: what the online step-cost model fits and what the scheduler
subclass inside the EngineCore measures (the twin's engine emits the same records)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStep:
    """One scheduler step: the tokens it prefilled, the sequences it decoded, the KV tokens those
    sequences attend over, and how long the step took (schedule to output, seconds).

    ``t_mono`` is ``time.monotonic()`` at the step's end; CLOCK_MONOTONIC is system-wide on Linux, so
    a value taken in the EngineCore process compares with the daemon's clock.
    """

    t_mono: float
    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    step_s: float
