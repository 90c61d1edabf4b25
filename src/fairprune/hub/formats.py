"""The names of ``--dtype`` and ``--save_format`` values, importable without torch (the options
that check them are read by ``prune.py --help``); :mod:`fairprune.hub.compressed` maps them."""

DTYPES = ("float32", "bfloat16", "float16")
SAVE_FORMATS = ("dense", "compressed")
