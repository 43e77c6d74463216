"""`python -m flagos COMMAND ...`: the same as the `flagos` console script."""
import sys

from .tools.cli import main

sys.exit(main())
