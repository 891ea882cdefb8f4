"""`python -m manual_train.bench --help`: see manual_train/bench/cli.py."""
import sys

from manual_train.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
