"""Run a script (or ``-c`` code) and print the peak resident memory of its life, for memory figures.

``python bench/peak_rss.py <script> [args ...]`` or ``python bench/peak_rss.py -c "<code>"``: runs
it in this process, then prints ``PEAK_RSS_KIB <n>`` as the last line and leaves without the
interpreter's shutdown. Tearing down torch and transformers alone raises the kernel's peak of a
bare ``import torch, transformers`` by about 0.13 GB (0.54 → 0.67 GB here), which is no part of
any run and would flatter every figure measured above it. Used by ``bench/streamed_prune.py`` and
the slow memory test in ``tests/test_streamed.py``, so runs and baselines are measured alike.
"""

import os
import resource
import runpy
import sys

sys.path.pop(0)  # this folder: the measured code imports as it would when started itself
argv, code = sys.argv[1:], 0
try:
    if argv[0] == "-c":
        exec(argv[1], {"__name__": "__main__"})
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:  # this image's own peak: ru_maxrss keeps the parent's resident size from before exec
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
except (OSError, StopIteration):
    pass
print("PEAK_RSS_KIB", peak, flush=True)
os._exit(code)
