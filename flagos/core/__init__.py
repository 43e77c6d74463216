"""The leaf layer: the active-chip state, the environment variables, op schema facts and the
per-op routes. It imports nothing of flagos but `errors` and the C extension."""
