"""`python -m manual_train.tune --help`: see manual_train/tune/__init__.py and manual_train/tune/cli.py."""
import sys

from manual_train.tune.cli import main

if __name__ == "__main__":
    sys.exit(main())
