"""`python -m nebula_cli.agent.keeper ...`: the Slurm keeper at its old name, run as
`python -m nebula_cli.schedulers.slurm.keeper ...` is."""

import sys

from nebula_cli.schedulers.slurm.keeper import main

sys.exit(main())
