"""`python -m gradcomm.perfmodel`: see `gradcomm.perfmodel.main`."""

import sys

from gradcomm.perfmodel._cli import main

if __name__ == "__main__":
    sys.exit(main())
