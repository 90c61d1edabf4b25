"""Command lines: ``train.py`` (LightningCLI), ``prune.py`` (jsonargparse) and ``make demo``.

Importing this package, before torch loads, sets ``OMP_WAIT_POLICY=PASSIVE`` unless the
environment sets it: OpenMP's threads then sleep as soon as they wait for work instead of spinning
for a while, so on a machine shared with other processes torch's threads do not burn the cores
the work needs (``bench/shared_machine.py`` measures it side by side). The library itself leaves
the environment alone.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
