"""Job roles: what a cluster runs (its worker processes' command, environment and files) and
which relay services it takes part in. `base.JobRole`, one module per role (`train`), routed by
name in `registry`; `config.jobplan` builds every worker agent through its cluster's role."""
