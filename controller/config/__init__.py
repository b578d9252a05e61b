"""config.toml: one typed table per TOML table, parsed and validated at once; the reload diff."""
