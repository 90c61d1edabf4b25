#!/usr/bin/env python
"""Prune trained models: ``python prune.py {vision,compare} --config ...`` (see README)."""

import sys

from fairprune.cli.prune import main

if __name__ == "__main__":
    sys.exit(main())
