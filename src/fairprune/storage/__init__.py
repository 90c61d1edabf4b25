"""File infrastructure, below every layer that writes: atomic writes (:mod:`.atomic`), the run-folder
lock (:mod:`.lock`) and the writability check. It imports nothing of fairprune but ``errors``."""
