"""`python -m lopa_fast ...` -> lopa_fast.cli.main."""
import sys

from lopa_fast.cli import main

sys.exit(main())
