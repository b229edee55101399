"""Schedulers: how a cluster's hosts are obtained, beside the transports that reach them.

`none` (the default) takes the spec's hosts as they are. `slurm` submits one batch job on the
cluster's login node and hands back the allocation's nodes, each reached through
`transport.slurmnode` (commands as ``srun --overlap`` steps from the login node). From the
agent down nothing knows which scheduler was used.

A Kubernetes scheduler would fit behind the same shape: submit (a Job or a set of pods), wait
for them with the reason they wait (the pods' events), hand back one host per pod with a
transport that runs commands through the API server's exec, and cancel (delete the Job).
"""
