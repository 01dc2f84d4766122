"""`python -m services.router ...` (see services.router.main)."""

import sys

from services.router.main import main

sys.exit(main(sys.argv[1:]))
