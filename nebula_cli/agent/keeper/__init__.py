"""The keeper's name before it moved to `nebula_cli.schedulers.slurm.keeper`: `python -m
nebula_cli.agent.keeper` (`__main__`) still runs it, for the batch scripts and node commands
that call it by this name (a running job's hosts run that job's uploaded copy). Standard
library only, as the keeper is."""
