import pytest


@pytest.fixture(autouse=True)
def _quiet_one_thread(quiet_single_thread):
    """Every reliability test: transformers quiet, one intra-op thread (tiny tensors: on a busy 2-core machine
    OpenMP's wake-ups made these tests ten times slower)."""
