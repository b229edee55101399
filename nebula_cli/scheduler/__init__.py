"""Schedulers at launch: how a cluster's hosts are obtained and ended, beside the transports
that reach them. `base.Allocator`, one module per scheduler that allocates (`slurm`: one batch
job on the cluster's login node, its nodes each reached through `transport.slurmnode_conn`),
routed by name in `registry`; what the spec and the plan know of a scheduler is
`config.schedulers`. From the agent down nothing knows which scheduler was used.

Slurm's own tools are `slurm_cli` (sbatch, squeue, sacct, scontrol, scancel on the login node)
and `batch` (the batch script). A Kubernetes scheduler would fit behind the same shape: submit
(a Job or a set of pods), wait for them with the reason they wait (the pods' events), hand back
one host per pod with a transport kind that runs commands through the API server's exec, and
cancel (delete the Job).
"""
