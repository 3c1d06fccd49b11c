"""Repository-wide pytest set-up."""

import os

import torch

# Under pytest-xdist every worker is a process: one intra-op thread each keeps 2 cores from thrashing.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
