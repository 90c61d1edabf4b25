"""Causal language models as the pipeline sees them: structure found from the model itself."""
