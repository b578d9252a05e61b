"""The AsyncLLM and its EngineCore: build, swap and stop it, the live batch cap, the stat logger, the
poll-sleep plugin.

``calls.py`` (every utility call into an EngineCore with a deadline, since vLLM's future for it waits for
ever on an EngineCore that hangs or died: past it the engine is silent, a drain fails at once and a
setting goes unawaited until it answers; retiring the engine, or the guard counting it failed, ends every
wait on it), ``host.py`` (builds, swaps and stops the ``AsyncLLM``, in ``vllm serve``'s usage context,
``args.SERVE_USAGE``; sets the batch cap and the token budget, drains the engine's steps), ``args.py``
(``[engine]`` and ``[server]`` to vLLM's own argument objects, name checks), ``dtype.py`` (an unset dtype
resolved from the CPU's flags: bfloat16 where it is native, float32 where it would be emulated),
``serve_args.py`` (the serve command line through vLLM's own serve parser, recording which options it
gave), ``parallel.py`` (the parallel keys checked together with vLLM's ``ParallelConfig`` and executor
lookup), ``scheduler.py`` (the scheduler subclass and EngineCore utilities that make the batch cap and the
token budget live and hand out the steps; the budget bounds steps that carry a decode, a step of prefill
alone takes up to ``max_num_batched_tokens``, as the twin's ``sim/engine.py`` plans them),
``stepmeter.py`` (each step's prefill tokens, decoding sequences, KV tokens and time, and the time since
the step before where a sequence ran on, measured in the EngineCore; no vLLM import), ``stats.py`` (vLLM
stat logger -> a step's ``stats`` published to the step feed, and each finished request to the outcome
sink), ``ipc.py`` (the vLLM plugin that lets the engine's processes sleep between polls), ``warmup.py``
(the warm-up's synthetic requests through the AsyncLLM, phased within a time budget, and the cost key:
model, dtype, step-relevant engine arguments, hardware, vLLM version), ``builds.py`` (an engine build in a
daemon thread that shutdown never waits for), ``heap.py`` (a retired engine's freed heap given back to the
OS with glibc's ``malloc_trim``: fragmentation, not a leak, grew the RSS at each rebuild), ``procs.py``
(how the engine's processes start: vLLM spawns each, on a GPU too, and a child forked from the daemon
drops its signal wakeup fd and handlers, so no child's SIGTERM reaches the daemon), ``death.py`` (why an
EngineCore died: it writes a note at its death, a CUDA out-of-memory error or not, which the host reads
for the guard's ``died_out_of_memory``).
"""
