import os
import sys

import pytest
import torch

# tests import the flat top-level modules (model, parallel, ...) from the repository root
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: extra intra-op threads only add overhead (and thrash a shared CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
