"""`python -m nebula_cli.agent start|status|stop DIR...`: see `nebula_cli.agent.supervisor`."""

import sys

from nebula_cli.agent.supervisor import main

sys.exit(main())
