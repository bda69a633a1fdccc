"""Kernels: paged KV access, attention, mHC; plain torch everywhere, Triton twins for GPUs."""

import os
import sys

import torch

# Without CUDA, Triton kernels can only run under Triton's interpreter, and Triton reads this
# setting when it is first imported (its own library functions are decorated then): set it before
# anything imports triton.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
