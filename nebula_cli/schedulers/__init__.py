"""The schedulers, one package each (`none/`, `slurm/`), registered once in `registry`."""
