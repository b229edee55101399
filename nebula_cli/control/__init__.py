"""The control plane on the launching machine: carries plans out over transports and records
them. `orchestrator` (launch), `jobs` (status, stop, logs of recorded jobs), `session` (one
transport per machine, safe from threads), `fanout` (one call per host, cancelled and waited
for), `state` (sqlite under $NEBULA_HOME), `follow` and `summaries` (log tails, metric
summaries), `hostcheck`, `netbench`, `dryrun`."""
