"""`python -m benchmarks.serving`: runs `benchmarks.serving.bench`."""

import sys

from benchmarks.serving.bench import main

sys.exit(main())
