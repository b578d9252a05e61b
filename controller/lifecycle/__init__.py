"""The daemon's life: startup, run, shutdown, signals, reload, the memory guard, systemd notify, logging.

The process. ``daemon.py`` is startup, run, shutdown and signals only (handlers record a signal; the run
loop acts on it; a forked child gets none of them, ``engine/runtime/procs.py``). ``parts.py`` builds every
part from the config in one place (``build_parts`` -> ``Parts``): the control core from
``control/build.ControlCore`` around the engine host, then what only the daemon has (metrics, the memory
guard, the diagnosis, the fit check) and the loop's subscribers, so the memory guard's restart trigger is
visible where the loop is wired. ``reload.py`` (``Reloader``, for SIGHUP and ``POST /reload``) parses the new
file, builds every part it swaps in (a ``LiveChange``: the control core's ``prepare``), then only assigns (the
core's ``apply``, as at the first build; the guard's ``configure``, the tick's interval); on any error the old
config stays. It refuses with a reason while the daemon starts (``Parts.starting``) or drains, runs one reload
at a time, and one task brings the engine to the newest file's ``[engine]`` (compared with the file the engine
runs, never with the guard's shrink in force). ``guard.py`` is the memory guard (drain and restart
the engine with new memory settings) and crash recovery with backoff and a budget (spent: the daemon exits
non-zero for its supervisor; a gate pause no restart holds ends); ``memory.py`` what it decides, pure: the
risk (``MemoryWatch``; on a GPU its margin at most half of what vLLM leaves free at the utilization in
force, ``gpu_margin_bytes``), the smaller setting (``shrink``) and ``MemoryRestarts``, the one decision,
cooldown, floor and back-off of memory restarts for every memory knob (a value that failed to build is the
floor; on a GPU one the free memory could not hold is retried at what it holds); ``liveness.py`` the stall
check (work in the engine and no step for ``stall_timeout_s``) that the guard recovers like a crash;
``warm.py`` where the step-cost model starts (a named profile, a state file of an earlier warm-up under
this engine's cost key, or a warm-up run before the daemon reports ready); ``tasks.py`` the one list of
background tasks; ``notify.py`` systemd READY / RELOADING / STOPPING / WATCHDOG (pinged only while the
control loop ticks: ``ControlLoop.stalled``, which ``/healthz`` reports as ``control_loop_stalled``);
``logs.py`` structlog, with vLLM's logs through it. It may import every room the daemon runs
(ARCHITECTURE.md's table), none of ``bench/``, ``sim/``, ``load/``. Invariant: shutdown has a deadline
and every background task is cancelled and awaited.
"""
