"""`python -m parstrat`: the command line."""

import sys

from parstrat._src.cli import main

if __name__ == "__main__":
  sys.exit(main())
