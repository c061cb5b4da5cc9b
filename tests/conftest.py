"""Shared test set-up.

Triton reads TRITON_INTERPRET when it is first imported: without a GPU its kernels can
only run under the interpreter, so set it before any test module imports triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
