"""Test set-up. Without CUDA, Triton kernels run on CPU tensors through the interpreter: the variable must be set
before any ``@triton.jit`` function is defined, so it is set here, first."""

import os

# No test reaches the network: on transformers 5.17 the family scan's tiny builds asked the hub for something and
# waited out its timeouts (test_structural_scan: 61 s against 15 s offline). Set before huggingface_hub is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# generate()'s compile-artifact cache (generate/warm_cache.py) stays off in tests: nothing written under ~/.cache;
# tests/generate/test_warm_cache.py turns it on for its own processes, in a temporary directory
os.environ.setdefault("MOECOMP_WARM_CACHE", "0")

# Tiny sizes for the token mixers that ``moecomp.coverage.families.TINY`` does not shrink (linear attention heads, Mamba
# heads / state / chunk): their defaults made one eager forward of a tiny model take seconds (glm5_next: 64 linear
# heads of 128, a [2, 64, 64, 64, 128] decay mask per layer) and a Dynamo trace of it tens of seconds. Likewise the
# hyper-connections' Sinkhorn loop (glm5_next, deepseek_v4): 2 iterations instead of 20 (the loop body still runs),
# which took 624 of the 2,440 nodes of glm5_next's whole-model graph (and half of deepseek_v4's 1,288). The MoE
# blocks (hidden 64, 8 experts, ...) and so everything the tests check are unchanged; only the attention / SSM /
# hyper-connection layers between them shrink. Merged into FAMILY_OVERRIDES for every test (pytest_configure below).
TEST_MIXER_SIZES = {
    "glm5_next": {"linear_num_heads": 4, "linear_head_dim": 16, "hc_sinkhorn_iters": 2},
    "deepseek_v4": {"hc_sinkhorn_iters": 2},
    "kimi_linear": {"linear_num_heads": 4, "linear_head_dim": 16},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 16},
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "chunk_size": 16},
}


def pytest_configure(config):
    from moecomp.coverage import families

    for family, sizes in TEST_MIXER_SIZES.items():
        families.FAMILY_OVERRIDES[family] = {**families.FAMILY_OVERRIDES.get(family, {}), **sizes}
    if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("MOECOMP_TEST_PLAIN_INTERPRETER"):
        skip_repatching_nested_calls()


# The body of triton.runtime.interpreter.InterpretedFunction.__call__ (a @triton.jit function called from a kernel)
# that skip_repatching_nested_calls replaces; any other body (another Triton) is left alone.
_NESTED_CALL_SOURCE = """
def __call__(self, *args, **kwargs):
    # This is a device function call
    _patch_lang(self.fn)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise InterpreterError(repr(e)) from e
"""


def skip_repatching_nested_calls() -> bool:
    """Under TRITON_INTERPRET=1, a @triton.jit helper called from a kernel (``dense_loop``, ``_rows``, activations,
    ...) runs ``_patch_lang`` again on every call of every program: an ``inspect.getmembers`` scan of triton.language,
    tl.core, tl.tensor, tl.math and the descriptor class that re-sets, to equivalent closures, what the kernel's launch
    (``GridExecutor``) has already patched and restores at its end. That scan was about a third of all interpreter
    time (tune --interpret: 24 s of 66 s). Here the helper call patches only the triton.language modules of its globals
    that are not patched yet (a module is patched when its ``load`` is no longer the builtin, which ``_patch_lang``
    replaces together with everything else of that module): the same state, the same kernels, the same numbers.
    tests/test_interpreter_patch.py checks the outputs are bit-identical to the plain interpreter's. Set
    MOECOMP_TEST_PLAIN_INTERPRETER=1 to run the plain one. Returns whether the method was replaced."""
    import inspect
    import textwrap

    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:  # pragma: no cover - no triton
        return False
    cls = getattr(ti, "InterpretedFunction", None)
    try:
        src = textwrap.dedent(inspect.getsource(cls.__call__))
    except (AttributeError, OSError, TypeError):  # pragma: no cover
        return False
    if src.strip() != _NESTED_CALL_SOURCE.strip() or getattr(cls.__call__, "_moecomp_fast", False):
        return False
    is_builtin, langs_of = tl.core.is_builtin, {}

    def patched(lang) -> bool:
        load = getattr(lang, "load", None)
        return load is not None and not is_builtin(load)

    def __call__(self, *args, **kwargs):
        # This is a device function call
        langs = langs_of.get(self.fn)
        if langs is None:
            langs = langs_of[self.fn] = [v for v in self.fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (tl, tl.core)]
        if not langs or not all(patched(lang) for lang in langs):
            ti._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    __call__._moecomp_fast = True
    __call__._moecomp_plain = cls.__call__
    cls.__call__ = __call__
    return True


# GPU tests on layers whose 16-bit experts take more than this hold tens of GiB each (DeepSeek-V3's 256 experts:
# 22.5 GB of weights, plus the fp32 reference's copies); in xdist workers sharing one GPU they run one at a time.
BIG_LAYER_BYTES = 8 << 30


def _big_layer(item) -> bool:
    from moecomp.testing import LAYER_PRESETS

    params = getattr(getattr(item, "callspec", None), "params", {})
    for value in params.values():
        spec = LAYER_PRESETS.get(value) if isinstance(value, str) else None
        if spec is not None:  # peak ~2.5x the 16-bit expert weights (the fp32 reference's copies): Scout's
            numel = sum(torch.Size(s).numel() for s in spec.expert_weight_shapes().values())  # 4 GB -> 10 GiB
            if 5 * numel > BIG_LAYER_BYTES:
                return True
    return False


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        for item in items:
            if "gpu" in item.keywords and _big_layer(item):
                item.add_marker(pytest.mark.bigmem)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _log_peak(path: str, nodeid: str, big: bool, alone: bool, before: int) -> None:
    """One line per GPU test that peaked over 2 GiB or still holds over 1 GiB when it ends (a fixture of wider
    scope), appended to ``path`` (pytest captures a passing test's stderr; ``benchmarks/run_gpu.sh tests`` prints the
    file): a test over ``BIG_LAYER_BYTES`` without the ``bigmem`` mark is flagged, it shared the GPU."""
    peak = torch.cuda.max_memory_allocated() - before
    held = torch.cuda.memory_allocated() - before
    if peak <= 2 << 30 and held <= 1 << 30:
        return
    flag = " UNMARKED-BIG" if peak > BIG_LAYER_BYTES and not big and not alone else ""
    with open(path, "a") as f:
        how = "bigmem" if big else "alone" if alone else "shared"
        f.write(f"{peak / 2**30:7.2f} GiB peak {held / 2**30:7.2f} GiB held {how}{flag} {nodeid}\n")


@pytest.fixture(autouse=True)
def _one_big_layer_at_a_time(request):
    """GPU tests share the device; a ``bigmem`` one has it alone. xdist workers hold a file lock while they run a GPU
    test: shared for ordinary ones, exclusive for ``bigmem`` ones, behind a turnstile lock (a waiting ``bigmem`` test
    lets no new test in, so it is not starved). Every GPU test gives its worker's cached blocks back when it ends, so
    that a ``bigmem`` test finds the memory the other workers' tests used free (on an 80 GB card two DeepSeek-V3-size
    tests of 28 GiB ran out of memory beside other workers' caches)."""
    if "gpu" not in request.node.keywords or not torch.cuda.is_available():
        yield
        return
    import fcntl
    import tempfile

    big = request.node.get_closest_marker("bigmem") is not None
    base = os.path.join(tempfile.gettempdir(), "moecomp-gpu-tests")
    with open(base + ".turnstile", "w") as gate, open(base + ".lock", "w") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            if not big:
                fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(lock, fcntl.LOCK_EX if big else fcntl.LOCK_SH)
        finally:
            if big:
                fcntl.flock(gate, fcntl.LOCK_UN)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        try:
            yield
        finally:
            _log_peak(base + ".peaks", request.node.nodeid, big, "exclusive" in request.node.keywords, before)
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


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
