"""``bench chaos``: faults and rude clients against our daemon under load, then the invariants."""
