"""Command lines: ``train.py`` (LightningCLI), ``prune.py`` (jsonargparse) and ``make demo``."""
