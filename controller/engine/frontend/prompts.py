"""How many ``generate()`` calls a request will make, known before its response starts.

vLLM's completion handler checks admission once (``_preflight(n)``) and then calls ``generate()``
once per prompt: a list of prompts passes admission as one request and arrives at the gate as many.
The gate must count them at admission, or one request fills the queue past every bound.
"""

from __future__ import annotations

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
