#!/usr/bin/env python
"""Train, validate or test a model: ``python train.py fit --config configs/vision/demo.yaml``."""

import sys

from fairprune.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
