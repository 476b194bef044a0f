"""`python -m innerq` is the `innerq` command."""
import sys

from .cli import main

sys.exit(main())
