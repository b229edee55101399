"""A skeleton scheduler, `dummy`, for tests only (never registered by nebula): what adding a
scheduler takes, one package (`scheduler`, `spec`) plus its line in
`nebula_cli.schedulers.registry.PACKAGES` (`tests/schedulers/test_registry.py` adds it)."""
