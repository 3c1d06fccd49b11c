import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import torch  # noqa: E402

from toy import build  # noqa: E402


@pytest.fixture
def model():
    """A fresh toy stack (6 blocks, width 16) for engine tests."""
    return build()


@pytest.fixture
def x():
    """Inputs for the toy stack."""
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
