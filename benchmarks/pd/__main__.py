"""`python -m benchmarks.pd`: runs `benchmarks.pd.bench`."""

import sys

from benchmarks.pd.bench import main

sys.exit(main())
