"""The synthetic sweep's shapes (SPEC §6). Pure Python: the headline lists them without importing torch.

Each is ``(label, width, depth, tokens)``: width 3072 at 1024/4096/16384 tokens (2x2-packed 64², 128², 256²
latents), and 32 layers x 4096 wide at 3072 tokens. Depth 15 puts the no-checkpoint peaks near SPEC §6's.
"""

from __future__ import annotations

SHAPES = [
    ("3072w x15, 1024 tok", 3072, 15, 1024),
    ("3072w x15, 4096 tok", 3072, 15, 4096),
    ("3072w x15, 16384 tok", 3072, 15, 16384),
    ("4096w x32, 3072 tok", 4096, 32, 3072),
]
TINY_SHAPE = ("64w x2, 64 tok (CPU smoke)", 64, 2, 64)
# the synthetic stack as a benchmark target: name -> index into SHAPES
SYNTHETIC_TARGETS = {
    "synthetic-1024": 0,
    "synthetic-4096": 1,
    "synthetic-16384": 2,
    "synthetic-4096w": 3,
}
