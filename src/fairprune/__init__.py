"""fairprune: fair pruning of vision and language models."""
__version__ = "0.1.0"
