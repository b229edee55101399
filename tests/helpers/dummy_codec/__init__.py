"""A skeleton codec package, `dummy` (not shipped): what adding a codec takes, a `params` and a
`codec` module plus its line in `nebula_cli.codecs.registry.PACKAGES` (tests/codecs/)."""
