"""The data plane's admission gate: priority classes, per-class queues, slots, early refusal with
Retry-After.
"""
