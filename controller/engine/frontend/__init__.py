"""vLLM's OpenAI app over a governed EngineClient: every request passes the admission gate."""
