"""`python -m sparsekv ...`: the sparsekv command line."""

import sys

from .cli import main

sys.exit(main())
