"""`scheduler: slurm`: the spec's `slurm:` section (`spec`), what it means for the plan
(`scheduler`), the allocator (`allocator`, `slurm_cli`, `batch` with `slurm.sbatch`), the
transport of a node (`node_conn`, `node_transport`) and the node's keeper (`keeper`: standard
library only, run on the nodes). Nothing is imported here: the nodes load `keeper` alone."""
