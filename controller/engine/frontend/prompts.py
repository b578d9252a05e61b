"""What admission must know of a request before its response starts, and vLLM has not rendered it yet.

How many ``generate()`` calls it will make: vLLM's completion handler checks admission once
(``_preflight(n)``) and then calls ``generate()`` once per prompt: a list of prompts passes admission as
one request and arrives at the gate as many. The gate must count them at admission, or one request
fills the queue past every bound.

How many tokens its prompts prefill: under SLO steering the gate refuses a request whose queue wait
plus its own prefill would miss its TTFT bound, and ``_preflight`` runs before vLLM tokenizes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from vllm.renderers.inputs.preprocess import prompt_to_seq


def generate_calls(request: Any) -> int:
    """One per prompt of a completion (``prompt`` and ``prompt_embeds``, split as vLLM's renderer
    splits them: a list of token ids is one prompt); one for every other request (a chat is one
    conversation)."""
    count = 0
    for field in ("prompt_embeds", "prompt"):
        value = getattr(request, field, None)
        if value is not None and not isinstance(value, (int, float)):
            try:
                count += len(prompt_to_seq(value))
            except TypeError:
                count += 1  # a shape vLLM will refuse with 400 anyway
    return max(1, count)


LONG_TEXT = 4096
"""Characters above which the text is encoded in a worker thread, off the event loop."""


def _texts_and_ids(request: Any) -> tuple[list[str], int] | None:
    """The request's prompt texts and its count of given token ids; None when the raw request does
    not say (embeddings, a shape vLLM will refuse)."""
    messages = getattr(request, "messages", None)
    if isinstance(messages, list):  # a chat: its messages' texts (the template adds a few tokens)
        texts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
            parts = content if isinstance(content, list) else [content]
            for part in parts:
                text = part.get("text") if isinstance(part, dict) else part
                if isinstance(text, str):
                    texts.append(text)
        return texts, 0
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    prompt = getattr(request, "prompt", None)
    if prompt is None or isinstance(prompt, (int, float)):
        return None
    try:
        prompts = prompt_to_seq(prompt)
    except TypeError:
        return None
    texts = [p for p in prompts if isinstance(p, str)]
    ids = sum(len(p) for p in prompts if isinstance(p, list))
    return texts, ids


async def prompt_tokens(request: Any, tokenizer: Any) -> int | None:
    """Tokens the request's prompts prefill: given token ids counted, text encoded with the served
    model's tokenizer; None when it cannot tell (no tokenizer for text, embeddings, a failure)."""
    found = _texts_and_ids(request)
    if found is None:
        return None
    texts, ids = found
    if not texts:
        return ids
    if tokenizer is None:
        return None
    text = "\n".join(texts)
    try:
        if len(text) > LONG_TEXT:
            encoded = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
        else:
            encoded = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # a tokenizer's own error: admission goes on without the prefill term
        return None
    return ids + len(encoded)
