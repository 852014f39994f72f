"""Test set-up. Without CUDA, Triton kernels run on CPU tensors through the interpreter: the variable must be set
before any ``@triton.jit`` function is defined, so it is set here, first."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def poison():
    """Fill every torch.empty with NaN (ints with their max) while the test runs: unwritten output shows."""
    import torch.utils.deterministic as det

    old_fill, old_det = det.fill_uninitialized_memory, torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    det.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    det.fill_uninitialized_memory = old_fill
    torch.use_deterministic_algorithms(old_det, warn_only=old_warn)


@pytest.fixture(params=["torch", "triton"])
def cpu_backend(request, monkeypatch):
    """Run the op's CPU path either as vectorised torch or as our Triton kernels under the interpreter."""
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", request.param)
    return request.param


@pytest.fixture
def quiet_single_thread():
    """Quiet transformers; one intra-op thread (tiny tensors: a second thread only adds wake-up latency)."""
    import transformers

    old, threads = transformers.logging.get_verbosity(), torch.get_num_threads()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity(old)
