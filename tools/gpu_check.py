"""A GPU-host check of the NVML sampler and of an 8B-class model's step-cost shape (no vLLM needed).

Run on a machine with a CUDA GPU, torch and nvidia-ml-py (the `device` machine of this workplace):

    python tools/gpu_check.py --out results/

1. NVML: ``controller.control.samplers.NvmlSource`` reads the GPU; allocating 8 GiB with torch must raise its
   ``used_bytes`` by about 8 GiB and lower ``free_bytes`` as much; a matmul loop must raise ``utilization``;
   ``CUDA_VISIBLE_DEVICES`` is honoured (index mapping).
2. Step cost: times the dense parts of one decoder step of a Llama-3.1-8B-shaped model (hidden 4096,
   intermediate 14336, 32 layers, 32 query / 8 KV heads, bf16, random weights) for a range of prefill token
   counts and decode batch sizes, and decode attention over a range of KV lengths, with CUDA events.
   These are lower bounds of a vLLM step (no sampling, scheduling or CUDA-graph effects) used to check the
   shape of the simulator's cost model ``a + b*prefill_tokens + c*decode_seqs + d*kv_tokens_read``.
Prints JSON and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

for _missing in ("structlog", "psutil"):  # the device's Python may lack them; NvmlSource only logs
    try:
        __import__(_missing)
    except ImportError:
        stub = types.ModuleType(_missing)
        stub.get_logger = lambda *a, **k: types.SimpleNamespace(  # type: ignore[attr-defined]
            info=print, warning=print, debug=print
        )
        sys.modules[_missing] = stub


def nvml_check() -> dict[str, object]:
    import torch

    from controller.control.samplers import NvmlSource

    src = NvmlSource()
    before = src.read()
    assert before is not None, f"NVML unavailable: {src.unavailable_reason}"
    block = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    time.sleep(0.5)
    after_alloc = src.read()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    utils = []
    t_end = time.monotonic() + 3.0
    while time.monotonic() < t_end:
        for _ in range(50):
            a @ a
        reading = src.read()
        assert reading is not None
        utils.append(reading.utilization)
    torch.cuda.synchronize()
    del block, a
    torch.cuda.empty_cache()
    time.sleep(0.5)
    after_free = src.read()
    assert after_alloc is not None and after_free is not None
    return {
        "before": before.__dict__,
        "after_8GiB_alloc": after_alloc.__dict__,
        "used_delta_GiB": (after_alloc.used_bytes - before.used_bytes) / (1 << 30),
        "free_delta_GiB": (before.free_bytes - after_alloc.free_bytes) / (1 << 30),
        "utilization_under_matmul_max": max(utils),
        "utilization_samples": len(utils),
        "after_release": after_free.__dict__,
    }


def _time(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1000.0


def step_cost() -> dict[str, object]:
    import torch
    import torch.nn.functional as F

    h, inter, layers, nq, nkv, hd = 4096, 14336, 32, 32, 8, 128
    dt, dev = torch.bfloat16, "cuda"
    w_qkv = torch.randn(h, (nq + 2 * nkv) * hd, device=dev, dtype=dt) * 0.01
    w_o = torch.randn(nq * hd, h, device=dev, dtype=dt) * 0.01
    w_gu = torch.randn(h, 2 * inter, device=dev, dtype=dt) * 0.01
    w_d = torch.randn(inter, h, device=dev, dtype=dt) * 0.01

    def dense(tokens: int) -> float:
        x = torch.randn(tokens, h, device=dev, dtype=dt)

        def layer() -> None:
            x @ w_qkv
            y = x @ w_o
            g = y @ w_gu
            (F.silu(g[:, :inter]) * g[:, inter:]) @ w_d

        return _time(layer) * layers

    def decode_attention(batch: int, kv_len: int) -> float:
        q = torch.randn(batch, nq, 1, hd, device=dev, dtype=dt)
        k = torch.randn(batch, nkv, kv_len, hd, device=dev, dtype=dt)
        v = torch.randn(batch, nkv, kv_len, hd, device=dev, dtype=dt)

        def attn() -> None:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return _time(attn) * layers

    dense_s = {n: dense(n) for n in (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)}
    attn_s = {
        f"{b}x{kv}": decode_attention(b, kv)
        for b, kv in ((1, 1024), (32, 1024), (64, 2048), (128, 1024), (256, 1024), (128, 4096), (256, 2048))
    }
    model = "llama-3.1-8b shapes, bf16, dense per step (s)"
    return {"model": model, "dense_s": dense_s, "decode_attn_s": attn_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    import torch

    result = {"device": torch.cuda.get_device_name(0), "nvml": nvml_check(), "step_cost": step_cost()}
    text = json.dumps(result, indent=2, default=str)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(text)


if __name__ == "__main__":
    main()
