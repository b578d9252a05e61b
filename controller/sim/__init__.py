"""The twin: a virtual-time vLLM engine behind the interfaces the control loop and the gate use.

``profile`` (cost model + engine limits, TOML), ``engine`` (vLLM V1's scheduler and paged KV cache),
``run`` (the real gate, telemetry window, policy, normalize stage and loop around it on a virtual
clock), ``cli`` (``simulate``). A profile is fitted from a real engine by ``bench calibrate``
(``controller/bench/calibrate/``).
"""
