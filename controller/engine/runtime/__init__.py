"""The AsyncLLM and its EngineCore: build, swap and stop it, the live batch cap, the stat logger, the
poll-sleep plugin.
"""
