"""The engine's dtype: ``[engine] dtype`` unset or "auto" resolves on an x86 CPU from its flags (bf16
where the CPU computes it natively, float32 where vLLM would emulate it); a set dtype passes through;
a GPU and a non-x86 CPU keep vLLM's auto. The flags come from a fake ``/proc/cpuinfo`` text."""

from __future__ import annotations

import pytest

from controller.engine.runtime import dtype as dtype_module
from controller.engine.runtime.args import engine_args, serve_namespace
from controller.engine.runtime.dtype import DtypeChoice, choose_dtype, dtype_settings, native_bf16_flag

AVX2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse avx2\n"
AVX512 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_tile amx_bf16 amx_int8\n"
SAPPHIRE_RAPIDS = "flags\t\t: fpu avx512f amx_bf16 avx512_bf16 amx_tile\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\n"


def _on_x86(requested: str | None, cpuinfo: str | None) -> DtypeChoice:
    return choose_dtype(requested, cpu=True, machine="x86_64", cpuinfo=cpuinfo)


@pytest.mark.parametrize(
    ("cpuinfo", "flag"),
    [(AVX2, None), (AVX512, None), (AVX512_BF16, "avx512_bf16"), (AMX, "amx_bf16"),
     (SAPPHIRE_RAPIDS, "avx512_bf16"), (ARM, None), ("", None)],
)  # fmt: skip
def test_the_native_bf16_flag_is_read_from_the_flags_lines(cpuinfo: str, flag: str | None) -> None:
    assert native_bf16_flag(cpuinfo) == flag


def test_a_flag_named_outside_the_flags_line_does_not_count() -> None:
    assert native_bf16_flag("model name\t: avx512_bf16 lookalike\nflags\t\t: fpu avx2\n") is None


@pytest.mark.parametrize("requested", [None, "auto", "AUTO"])
def test_auto_on_an_x86_cpu_with_native_bf16_is_bfloat16(requested: str | None) -> None:
    assert _on_x86(requested, AVX512_BF16) == DtypeChoice("bfloat16", "cpu has avx512_bf16: bfloat16")
    assert _on_x86(requested, AMX) == DtypeChoice("bfloat16", "cpu has amx_bf16: bfloat16")


@pytest.mark.parametrize("cpuinfo", [AVX2, AVX512])
def test_auto_on_an_x86_cpu_without_native_bf16_is_float32(cpuinfo: str) -> None:
    assert _on_x86(None, cpuinfo) == DtypeChoice(
        "float32", "cpu lacks native bf16: float32, bf16 would be emulated"
    )


def test_unreadable_cpu_flags_on_x86_are_float32() -> None:
    choice = _on_x86("auto", None)
    assert choice.dtype == "float32" and choice.reason.startswith("cpu flags unreadable")


@pytest.mark.parametrize("requested", ["float32", "bfloat16", "half", "float16"])
def test_a_dtype_the_user_sets_passes_through(requested: str) -> None:
    for cpuinfo in (AVX2, AVX512_BF16):
        assert _on_x86(requested, cpuinfo) == DtypeChoice(requested, f"set in [engine] dtype: {requested}")
    assert choose_dtype(requested, cpu=False, machine="x86_64", cpuinfo=AVX2).dtype == requested


def test_a_gpu_keeps_vllms_auto() -> None:
    choice = choose_dtype(None, cpu=False, machine="x86_64", cpuinfo=AVX2)
    assert choice == DtypeChoice("auto", "not a cpu: vLLM's auto (the model's own dtype)")


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "s390x", "riscv64"])
def test_a_cpu_other_than_x86_keeps_vllms_auto(machine: str) -> None:
    choice = choose_dtype("auto", cpu=True, machine=machine, cpuinfo=ARM)
    assert choice.dtype == "auto" and choice.reason.startswith(f"cpu is {machine}: vLLM's auto")


@pytest.fixture
def avx2_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's platform read as an x86 CPU without native bf16."""
    monkeypatch.setattr(dtype_module, "_platform", lambda: (True, "x86_64", AVX2))


@pytest.fixture
def bf16_box(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_module, "_platform", lambda: (True, "x86_64", AMX))


@pytest.mark.usefixtures("avx2_box")
def test_vllms_engine_args_get_the_resolved_dtype_when_none_is_set() -> None:
    assert engine_args(serve_namespace({"model": "/models/tiny"}, {})).dtype == "float32"


@pytest.mark.usefixtures("bf16_box")
def test_vllms_engine_args_get_bfloat16_on_a_cpu_with_amx() -> None:
    assert engine_args(serve_namespace({"model": "/models/tiny", "dtype": "auto"}, {})).dtype == "bfloat16"


@pytest.mark.usefixtures("bf16_box")
def test_vllms_engine_args_keep_a_set_dtype() -> None:
    namespace = serve_namespace({"model": "/models/tiny", "dtype": "float32"}, {})
    assert engine_args(namespace).dtype == "float32"
    assert namespace.dtype == "float32"  # the namespace keeps what was asked (a restart resolves again)


@pytest.mark.usefixtures("bf16_box")
def test_state_shows_the_built_engines_dtype_and_the_reason() -> None:
    import torch

    assert dtype_settings("auto") == {"dtype": "bfloat16", "dtype_reason": "cpu has amx_bf16: bfloat16"}
    assert dtype_settings("auto", torch.bfloat16) == {
        "dtype": "bfloat16",
        "dtype_reason": "cpu has amx_bf16: bfloat16",
    }
    assert dtype_settings("float16", torch.float16)["dtype_reason"] == "set in [engine] dtype: float16"


@pytest.mark.usefixtures("avx2_box")
def test_drop_in_mode_resolves_the_dtype_and_keeps_prefix_caching_on() -> None:
    """``vllm-autopilot serve MODEL`` without --dtype: resolved per CPU; prefix caching left to vLLM
    (its default: on); --dtype given: passed through."""
    from controller.config.cli_layer import serve_config

    config = serve_config(["models/tiny"])
    assert "dtype" not in config.engine and "enable_prefix_caching" not in config.engine
    eargs = engine_args(serve_namespace(config.engine, {}))
    assert eargs.dtype == "float32" and eargs.enable_prefix_caching is None  # None: vLLM's default, on
    given = serve_config(["models/tiny", "--dtype", "bfloat16"])
    assert engine_args(serve_namespace(given.engine, {})).dtype == "bfloat16"
