"""Shared helpers for the HF integration tests (tiny random-weight models, fp32, CPU)."""

import pytest
import torch

pytest.importorskip("transformers")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "families: the sweep over every transformers MoE family (tiny models; CI runs it)")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (what 'within 1e-4 relative' means in these tests)."""
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(autouse=True)
def _quiet_single_thread(quiet_single_thread):
    """Every test here runs quiet and single-threaded (the shared fixture in tests/conftest.py)."""
