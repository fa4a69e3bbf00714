"""Shared pytest set-up.

Without a GPU, Triton kernels run under the CPU interpreter: TRITON_INTERPRET must be set before the
first `import triton`, so it is set here, at collection time (importing torch does not import triton).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
