"""Schedulers as the spec and the plan see them: `base.Scheduler`, one module per scheduler
(`none`, `slurm`; the `slurm:` section's model is `slurm_spec`), routed by name in `registry`.
The control plane's side (submitting, waiting, cancelling) is `nebula_cli.scheduler`."""
