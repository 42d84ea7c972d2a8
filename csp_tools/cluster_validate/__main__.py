"""`python -m csp_tools.cluster_validate --config F`: the node agent (node.py) that the job script starts."""

import sys

from csp_tools.cluster_validate.node import main

sys.exit(main())
