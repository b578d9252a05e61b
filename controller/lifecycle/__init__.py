"""The daemon's life: startup, run, shutdown, signals, reload, the memory guard, systemd notify, logging."""
