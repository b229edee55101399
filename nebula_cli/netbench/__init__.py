"""bench-network's probe, the one part of it that runs on hosts: a server on each dialled
gateway (:mod:`~nebula_cli.netbench.probe`) and a measurer on each dialling one
(:mod:`~nebula_cli.netbench.measure`). The control plane's side is
:mod:`nebula_cli.control.netbench`."""
