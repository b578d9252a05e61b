"""What a benchmark sends and the one client that sends it: workloads, prompts, the streaming SSE client."""
