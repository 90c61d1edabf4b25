#!/usr/bin/env python
"""Prune trained models: ``python prune.py {vision,compare} --config ...`` (see README)."""

import sys

from fairprune.prune_cli import main

if __name__ == "__main__":
    sys.exit(main())
