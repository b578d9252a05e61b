"""The control plane: the aiohttp server (/metrics, /state, /healthz, /reload), the typed status view,
the Prometheus metrics.
"""
