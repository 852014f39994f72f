import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tiny_models


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test traces from scratch (no cache entries or recompile counts left by another test)."""
    import moecomp

    torch._dynamo.reset()
    moecomp.counters.clear()
    yield
    torch._dynamo.reset()
