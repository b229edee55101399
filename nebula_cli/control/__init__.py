"""The control plane on the launching machine: carries plans out over transports and records
them (`orchestrator`, `state`, `fanout`, `follow`, `hostcheck`, `netbench`, `dryrun`)."""
