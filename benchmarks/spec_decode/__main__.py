"""`python -m benchmarks.spec_decode`: runs `benchmarks.spec_decode.bench`."""

import sys

from benchmarks.spec_decode.bench import main

sys.exit(main())
