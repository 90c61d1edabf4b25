"""The names of ``--dtype``, ``--save_format`` and ``--quantize`` values, importable without torch (the options
that check them are read by ``prune.py --help``); :mod:`fairprune.hub.compressed` maps them."""

DTYPES = ("float32", "bfloat16", "float16")
SAVE_FORMATS = ("dense", "compressed")
QUANTIZE = ("none", "w4a16", "w8a16", "w4a16-gptq", "w8a16-gptq")

#: ``prune.py export --format`` and ``--gguf_type`` (:mod:`fairprune.hub.gguf_file`).
EXPORT_FORMATS = ("onnx", "gguf")
GGUF_TYPES = ("f16", "q8_0", "q4_0")
