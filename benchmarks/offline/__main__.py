"""`python -m benchmarks.offline`: runs `benchmarks.offline.bench`."""

import sys

from benchmarks.offline.bench import main

sys.exit(main())
