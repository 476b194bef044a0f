"""`python -m innerq.server [MODEL] [flags]` is `innerq serve`."""
import sys

from ..cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
