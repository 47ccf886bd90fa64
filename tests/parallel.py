"""The mark of tests whose engines run two ranks (tensor, pipeline or data parallel 2): one CPU core a rank on CPU,
one GPU a rank on a CUDA machine, so they skip on a machine with one GPU."""

import pytest
import torch

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_ranks = pytest.mark.skipif(0 < _GPUS < 2, reason=f"two ranks need two GPUs on a CUDA machine, this one has {_GPUS}")
