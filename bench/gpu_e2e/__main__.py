"""``python -m bench.gpu_e2e``: see the package docstring."""

import sys

from bench.gpu_e2e.cli import main

sys.exit(main())
