"""The only code that imports vLLM: the engine runtime (host, args, scheduler, stats, ipc) and the
serving front end.
"""
