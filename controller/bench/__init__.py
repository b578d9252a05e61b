"""`vllm-autopilot bench`: servers under test, one run against each, and the experiments built on them."""
