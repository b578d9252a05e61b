"""Build the local test model: a byte-level BPE tokenizer and a random-init Llama.

No model can be downloaded on the CPU dev/CI machines, so the project makes its own. The text it
generates is noise; the engine that runs it is real: vLLM builds, schedules, batches and caches for
it exactly as for a real model (engine start ~15 s on a 2-core CPU).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 2048
MARKER = "config.json"

_WORDS = (
    "the engine serves requests while the controller measures cache usage queue depth latency and "
    "throughput then moves the admission limit and batch cap so that operators sleep at night a "
    "policy decides and the loop applies each change with a reason every token costs memory and time"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 30))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 100_000)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ""]))
    return lines


def build_tokenizer(out: Path, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(out: Path, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": True}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def make_tiny_model(out: Path, seed: int = 0) -> Path:
    """Build the model into ``out`` (created if needed); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, seed)
    build_model(out, seed)
    return out


def ensure_tiny_model(out: Path) -> Path:
    """Build the model unless ``out`` already holds one."""
    if (out / MARKER).exists() and (out / "tokenizer.json").exists():
        return out
    return make_tiny_model(out)
