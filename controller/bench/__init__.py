"""`vllm-autopilot bench`: load generation, workloads, goodput, sweep/compare/soak, reports."""
