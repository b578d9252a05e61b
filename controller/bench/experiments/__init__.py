"""The bench's experiments, one module a command: compare, sweep, soak, overload, frontend."""
