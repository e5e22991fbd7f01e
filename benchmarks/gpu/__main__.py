"""`python -m benchmarks.gpu`: runs `benchmarks.gpu.check`."""

import sys

from benchmarks.gpu.check import main

sys.exit(main())
