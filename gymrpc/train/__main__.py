"""`python -m gymrpc.train init|run`: the same as `gymrpc train init|run`."""

import sys

from gymrpc.train.command import main

if __name__ == "__main__":
    sys.exit(main())
