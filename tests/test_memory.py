"""Recognition in bounded memory, retries when a probe does not fit, and no silent fallbacks (issue 39).

* ``optimize`` / ``scan`` / the compile backend hold at most one plain forward's working memory of the block plus
  ``policy.WORKING_MEMORY_BYTES``, whatever the expert count or format: blocks of 256 experts whose w13 and w2,
  dequantized to fp32 all at once, would take over ten times the bound the tests set (``BOUND``), in bf16, FP8 (block
  and per-channel scales), MXFP4 and int4. Measured with ``moecomp.testing.PeakMemory`` (every CPU allocation while
  active; the lead runs the same on the GPU: ``benchmarks/mem_optimize.py``).
* A probe that runs out of memory is tried again (the numeric check on fewer tokens, then on CPU copies; the verify
  stage on a smaller probe, then on a CPU copy of the block): the block is still rewritten and the report says so.
* An out-of-memory error that is not recovered reaches the report with its stage, type and message, ahead of what a
  later reader says; ``optimize`` warns once (``strict=True``: ``OptimizeError``); ``scan`` reports the same.

Tolerances: the rewritten block against its own forward on fresh inputs, max |a - b| / max |b|: ``TOL`` per format
(bf16 and 4-bit: the bf16 verify tolerance; FP8: the FP8 verify tolerance, policy.py says why).
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.core import policy
from moecomp.verify import verify  # noqa: E402
from moecomp.recognise import fallback  # noqa: E402
from moecomp.coverage import families as F  # noqa: E402
from moecomp.recognise.structure import find_parts  # noqa: E402
from moecomp.formats.fp8 import plain_fp8  # noqa: E402
from moecomp.recognise.fx import numeric as _numeric  # noqa: E402
from moecomp.testing import PeakMemory, forward_peak  # noqa: E402
from moecomp.testing.blocks import one_block  # noqa: E402

O = importlib.import_module("moecomp.api.whole")  # (the whole-block rewrite: its probe tries, ``_tries``)

BOUND = 4 << 20  # policy.WORKING_MEMORY_BYTES in these tests
E, H, I, K = 256, 128, 128, 8  # all experts' w13 + w2 in fp32: 256 * 3 * 128 * 128 * 4 bytes = 50 MB > 10 BOUND
TOL = {"bf16": policy.VERIFY_TOLERANCE[torch.bfloat16], "mxfp4": policy.VERIFY_TOLERANCE[torch.bfloat16],
       "int4": policy.VERIFY_TOLERANCE[torch.bfloat16], "fp8": policy.VERIFY_TOLERANCE_FP8,
       "fp8-channel": policy.VERIFY_TOLERANCE_FP8}
CELLS = [("qwen3_moe", "bf16"), ("qwen3_moe", "fp8"), ("qwen3_moe", "fp8-channel"), ("gpt_oss", "mxfp4"),
         ("qwen3_moe", "int4")]


@pytest.fixture(autouse=True)
def _quiet_single_thread(quiet_single_thread):
    """Quiet and single-threaded (tests/conftest.py)."""


def _primary(out):
    return out[0] if isinstance(out, tuple) else out


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max())


def _agrees(block, x, got, want, tol) -> bool:
    """``got`` (the rewritten block) against ``want`` (its own forward) on ``x``: within ``tol`` of want's largest
    value on every token but at most ``policy.max_tie_tokens`` whose routing sits within a bf16 rounding of a tie
    (the two router GEMMs may round such a token's logits apart: the verify stage's rule)."""
    from moecomp.oracle import reference
    from moecomp.bind.bind import resolve as _resolve

    st = block._moecomp
    t = [None if p is None else _resolve(block, p) for p in st.paths[:3]]
    x2 = x.reshape(-1, x.shape[-1])
    near = reference.near_tie_tokens(x2, *t, st.op_spec or st.spec, policy.TIE_REL[torch.bfloat16])
    g, w = got.float().reshape(x2.shape), want.float().reshape(x2.shape)
    bad = (g - w).abs().amax(-1) / w.abs().max() > tol
    return bool(torch.isfinite(g).all()) and int(bad.sum()) <= policy.max_tie_tokens(len(bad)) and not bool(
        (bad & ~near).any())


def _plain_peak(model, x) -> int:
    with plain_fp8(model):
        return forward_peak(model.mlp, x)


# ----------------------------------------------------------------------------------------------- the tracker
def test_peak_memory_sees_temporaries_inside_custom_ops():
    """``PeakMemory`` counts what is allocated while active (freed or not), including the temporaries inside a custom
    op (``dequant_4bit`` unpacks codes a chunk at a time), and nothing held before."""
    from moecomp.formats.packed import dequant_4bit  # noqa: F401  (registers the op)
    from moecomp.core.spec import QuantSpec
    from moecomp.core import quant as q8

    held = torch.randn(1 << 20)  # 4 MB held before: not counted
    q, s, _ = q8.quantize_4bit(torch.randn(64, 1024), QuantSpec.mxfp4())
    with PeakMemory() as m:
        kept = torch.empty(1 << 20)  # 4 MB, still held at the end
        tmp = torch.empty(1 << 22)  # 16 MB, freed
        del tmp
        w = torch.ops.moecomp.dequant_4bit(q, s, None, QuantSpec.mxfp4().key)  # 256 KB result + its temporaries
    mb = 1 << 20
    assert 20 * mb <= m.peak <= 21 * mb, m.peak
    assert 4 * mb + w.numel() * 4 <= m.end <= 4 * mb + w.numel() * 4 + 4096, m.end
    assert held.numel() and kept.numel()


# ----------------------------------------------------------------------------------------------- bounded memory
@pytest.mark.parametrize("family,fmt", CELLS)
def test_optimize_within_bound(family, fmt, monkeypatch):
    monkeypatch.setattr(policy, "WORKING_MEMORY_BYTES", BOUND)
    model = one_block(family, fmt, E=E, H=H, I=I, k=K)
    assert E * 3 * H * I * 4 > 10 * BOUND  # all experts dequantized at once would not fit
    dtype = torch.bfloat16
    x = policy.probe_input(H, "cpu", dtype)
    plain = _plain_peak(model, x)
    x2 = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad(), plain_fp8(model):
        want = _primary(model.mlp(x2))
    with PeakMemory() as m:
        _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    assert [b.status for b in rep.blocks] == ["rewritten"], rep
    assert m.peak <= plain + BOUND, f"{fmt}: optimize took {m.peak / 1e6:.2f} MB, plain forward {plain / 1e6:.2f} MB"
    with torch.no_grad():
        got = _primary(model.mlp(x2))
    assert _agrees(model.mlp, x2, got, want, TOL[fmt])


def test_scan_within_bound(monkeypatch):
    monkeypatch.setattr(policy, "WORKING_MEMORY_BYTES", BOUND)
    model = one_block("gpt_oss", "mxfp4", E=E, H=H, I=I, k=K)
    plain = _plain_peak(model, policy.probe_input(H, "cpu", torch.bfloat16))
    with PeakMemory() as m:
        rep = moecomp.scan(model)
    assert [b.status for b in rep.blocks] == ["supported"], rep
    assert m.peak <= plain + BOUND, (m.peak, plain)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_backend_within_bound(dynamic, monkeypatch):
    """The backend's first call (capture, numeric check, the call itself) against one plain forward plus the
    bound; the block becomes one moe_forward. Static shapes: the check would gather more than the bound at the traced
    token count, so the match rests on the structure (and says so); dynamic: the check runs on fewer tokens."""
    import moecomp.api.backend as B

    monkeypatch.setattr(policy, "WORKING_MEMORY_BYTES", BOUND)
    model = one_block("qwen3_moe", "fp8", E=E, H=H, I=I, k=2)  # (top-2: 4 tokens' gathered weights fit the bound)
    x = policy.probe_input(H, "cpu", torch.bfloat16)
    plain = _plain_peak(model, x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moecomp", dynamic=dynamic, options={"moecomp.inner": "eager"})
    replaced = moecomp.counters["rewrite_moe"]["replaced"]
    with torch.no_grad(), PeakMemory() as m:
        compiled(x)
    assert moecomp.counters["rewrite_moe"]["replaced"] == replaced + 1, B.last_results[-1]["rejected"]
    assert m.peak <= plain + BOUND, (m.peak, plain)
    (how,) = B.last_results[-1]["matches"]
    assert ("skipped: the gathered expert weights" in how) != dynamic and ("numeric" in how) == dynamic, how


# ----------------------------------------------------------------------------------------------- retries
def _small(family="qwen3_moe", fmt="bf16"):
    return one_block(family, fmt, E=8, H=64, I=32, k=2)


def _fail_first(monkeypatch, module, name, n=1, when=lambda *a, **k: True):
    """``module.name`` raising ``torch.OutOfMemoryError`` on its first ``n`` calls that ``when`` accepts."""
    real, left = getattr(module, name), [n]

    def wrapper(*a, **k):
        if left[0] and when(*a, **k):
            left[0] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.80 GiB (injected)")
        return real(*a, **k)

    monkeypatch.setattr(module, name, wrapper)


def test_numeric_check_out_of_memory_retries_on_fewer_tokens(monkeypatch):
    _fail_first(monkeypatch, _numeric, "_check")
    _, rep = moecomp.optimize(_small(), report=True, fast_generate=False)
    b = rep.blocks[0]
    assert b.status == "rewritten" and b.method == "fx", rep
    note = next(n for n in b.notes if n.startswith("FX numeric check ran out of memory"))
    assert f"{policy.FX_CHECK_TOKENS} tokens: CUDA out of memory" in note, note
    assert f"numeric, {policy.FX_CHECK_MIN_TOKENS} tokens" in note, note


def test_numeric_check_out_of_memory_retries_on_the_cpu(monkeypatch):
    """A block off the CPU (the device faked here) whose check runs out on the device every time: the check runs on
    CPU copies, its graph's devices made the CPU."""
    monkeypatch.setattr(_numeric, "_device", lambda ctx, inputs: torch.device("cuda", 0))
    _fail_first(monkeypatch, _numeric, "_check", n=2, when=lambda *a, **k: not a[-1])  # (on_cpu is the last)
    _, rep = moecomp.optimize(_small(), report=True, fast_generate=False)
    b = rep.blocks[0]
    assert b.status == "rewritten" and b.method == "fx", rep
    note = next(n for n in b.notes if n.startswith("FX numeric check ran out of memory"))
    assert "tokens on the CPU (" in note and note.count("CUDA out of memory") == 2, note


def test_verify_out_of_memory_retries_on_a_smaller_probe(monkeypatch):
    _fail_first(monkeypatch, verify, "_run_op")
    model = _small("gpt_oss", "mxfp4")
    _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    b = rep.blocks[0]
    assert b.status == "rewritten", rep
    n = policy.RETRY_PROBE_SHAPE[0] * policy.RETRY_PROBE_SHAPE[1]
    note = next(x for x in b.notes if x.startswith("recognised and verified"))
    assert f"with {n} probe tokens on cpu" in note and "verify: OutOfMemoryError: CUDA out of memory" in note, note


def test_verify_out_of_memory_retries_on_a_cpu_copy(monkeypatch):
    """The last try: a CPU copy of the block (made one tensor at a time); the Match binds the block itself (the op
    reads the block's own tensors, not the copy's)."""
    monkeypatch.setattr(O, "_tries", lambda device: [(policy.PROBE_SHAPE, False), (policy.PROBE_SHAPE, True)])
    _fail_first(monkeypatch, verify, "_run_op")
    model = _small("qwen3_moe", "int4")
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        want = model.mlp(x)
    ptrs = {k: t.data_ptr() for k, t in model.mlp.experts.named_parameters()}
    _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    b = rep.blocks[0]
    assert b.status == "rewritten", rep
    assert any("on a CPU copy of the block after running out of memory" in n for n in b.notes), b.notes
    st = model.mlp._moecomp
    assert st.bindings["w13"] == "experts.w13"
    assert {k: t.data_ptr() for k, t in model.mlp.experts.named_parameters()} == ptrs
    counter = F.OpCounter()
    with torch.no_grad(), counter:
        got = model.mlp(x)
    assert counter.calls == 1 and _rel(got, want) <= TOL["int4"]


# ----------------------------------------------------------------------------------------------- no silent fallbacks
def _oom_everywhere(monkeypatch):
    _fail_first(monkeypatch, _numeric, "_check", n=10 ** 6)


def test_unrecovered_oom_reaches_the_report(monkeypatch):
    """The FX pass's check runs out of memory on every try: the block's reason names the stage, the exception and
    its message first, then the attribute reader's own refusal (it does not read 4-bit experts); one warning;
    ``strict=True`` raises naming the block; ``scan`` says the same."""
    _oom_everywhere(monkeypatch)
    model = _small("gpt_oss", "mxfp4")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    b = rep.blocks[0]
    assert b.status == "skipped", rep
    why = b.reason
    assert "FX pass failed (numeric check: OutOfMemoryError:" in why and "15.80 GiB" in why, why
    parts = find_parts(model.mlp)
    reader = fallback.recognise(model.mlp, parts, policy.probe_input(parts.hidden_size, "cpu", torch.bfloat16))
    reader = reader.message
    assert why.index("OutOfMemoryError") < why.index(f"then attribute reader: {reader[:40]}"), why  # first cause first
    ours = [w for w in seen if "left unrewritten" in str(w.message)]
    assert len(ours) == 1 and "mlp" in str(ours[0].message) and "strict=True" in str(ours[0].message)
    assert not hasattr(model.mlp, "_moecomp") or model.mlp._moecomp is None
    assert rep.generate == ""  # nothing rewritten: generate left as it was
    with pytest.raises(moecomp.OptimizeError, match=r"(?s)1 of 1 MoE block.*mlp: FX pass failed \(numeric check: "
                                                    r"OutOfMemoryError") as e:
        moecomp.optimize(_small("gpt_oss", "mxfp4"), fast_generate=False, strict=True)
    assert [b.name for b in e.value.blocks] == ["mlp"] and e.value.report.blocks[0].status == "skipped"
    assert moecomp.scan(_small("gpt_oss", "mxfp4")).blocks[0].reason == why


def test_exceptions_reach_the_report_first_cause_first(monkeypatch):
    """The FX pass's check raises (not out of memory), then the attribute reader raises too: the reason names both
    stages, types and messages, the first cause first."""
    def broken(name):
        def fn(*a, **k):
            raise {"check": RuntimeError, "reader": ValueError}[name](f"the {name} broke")
        return fn

    monkeypatch.setattr(_numeric, "_check", broken("check"))
    monkeypatch.setattr(fallback, "recognise", broken("reader"))
    rep = moecomp.scan(_small("gpt_oss", "mxfp4"))
    why = rep.blocks[0].reason
    assert rep.blocks[0].status == "skipped", rep
    first, then = "FX pass failed (numeric check: RuntimeError: the check broke)", \
        "attribute reader: ValueError: the reader broke"
    assert first in why and then in why and why.index(first) < why.index(then), why


def test_healthy_blocks_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, rep = moecomp.optimize(_small(), report=True, fast_generate=False, strict=True)
    assert [b.status for b in rep.blocks] == ["rewritten"]


# ----------------------------------------------------------------------------------------------- benchmarks
def test_generate_benchmark_on_an_unoptimized_model(monkeypatch, tmp_path):
    """``benchmarks/bench_generate_quant4.py`` when optimize leaves every block (the FX pass's check out of memory
    on every try): no crash at ``model.generate.<attr>``; the JSON records what optimize left and why, the run
    ends with an error that says so."""
    import json
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    monkeypatch.syspath_prepend(bench)
    q4 = importlib.import_module("bench_generate_quant4")
    _oom_everywhere(monkeypatch)
    out = tmp_path / "q4.json"
    assert q4.main(["--device", "cpu", "--tiny", "--batches", "1", "--hf-new", "2", "--out-json", str(out)]) == 1
    res = json.loads(out.read_text())
    st = res["optimize"]
    assert st["generate_replaced"] is False and st["rewritten"] == 0 and len(st["unrewritten"]) == st["blocks"] > 0
    assert all("numeric check: OutOfMemoryError" in b["reason"] for b in st["unrewritten"]), st
    assert res["rows"] == [] and any("did not replace generate" in e for e in res["errors"]), res["errors"]
    assert "bench_generate" in sys.modules


# ----------------------------------------------------------------------------------------------- on the GPU
GPU_CELLS = [("gpt_oss", "mxfp4", 128, 2880, 2880, 4),  # gpt-oss-120b's layer: the one that asked for 15.8 GiB
             ("deepseek_v3", "fp8", 256, 7168, 2048, 8),  # DeepSeek-V3's
             ("qwen3_moe", "int4", 16, 5120, 8192, 1)]  # Llama 4 Scout's sizes


@pytest.mark.gpu
@pytest.mark.bigmem
@pytest.mark.parametrize("family,fmt,e,h,i,k", GPU_CELLS)
def test_optimize_within_bound_on_the_gpu(family, fmt, e, h, i, k):
    """At real layer sizes on CUDA, the default bound (1 GiB): ``torch.cuda.max_memory_allocated`` during
    ``optimize`` above what was held before, against one plain forward plus the bound; the block is rewritten and
    agrees with its own forward (bf16 / FP8 tolerance, near ties excused)."""
    dev = torch.device("cuda")
    model = one_block(family, fmt, E=e, H=h, I=i, k=k, device=dev)
    x = policy.probe_input(h, dev, torch.bfloat16)
    plain = _plain_peak(model, x)
    x2 = torch.randn(2, 9, h, generator=torch.Generator().manual_seed(5)).to(dev, torch.bfloat16)
    with torch.no_grad(), plain_fp8(model):
        want = _primary(model.mlp(x2))
    with PeakMemory(dev) as m:
        _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    assert [b.status for b in rep.blocks] == ["rewritten"], rep
    assert m.peak <= plain + policy.working_bytes(), (m.peak, plain)
    with torch.no_grad():
        got = _primary(model.mlp(x2))
    assert _agrees(model.mlp, x2, got, want, TOL[fmt])


def test_random_moe_args_draws_large_stacks_a_slice_at_a_time(monkeypatch):
    """``random_moe_args`` draws a weight stack over ``testing.CHUNK_BYTES`` of fp32 one expert at a time (the tuner
    ran out of memory on an 80 GB H100 drawing DeepSeek-V3's 28 GiB fp32 w13 before its bf16 cast): the peak is the
    bf16 stacks plus one fp32 slice and its scaled copy, not their fp32 copies; the draw keeps N(0, std), differs per
    expert and repeats with the seed."""
    import moecomp.testing as mt
    from moecomp.core.spec import MoESpec

    spec = MoESpec(num_experts=16, top_k=2, hidden_size=256, intermediate_size=512)
    bf16_bytes = sum(2 * torch.Size(s).numel() for n, s in spec.expert_weight_shapes().items() if n in ("w13", "w2"))
    slice_fp32 = 4 * 2 * 512 * 256  # one expert's w13 in fp32
    monkeypatch.setattr(mt, "CHUNK_BYTES", 4096)
    with PeakMemory() as m:
        args = mt.random_moe_args(spec, 4, torch.bfloat16, std=0.02, seed=3)
    w13 = args[1 + list(mt.MOE_ARGS).index("w13")]
    assert w13.shape == (16, 1024, 256) and w13.dtype == torch.bfloat16
    assert m.peak <= bf16_bytes + 2 * slice_fp32 + (1 << 20), (m.peak, bf16_bytes)  # fp32 copies would add 2x
    assert abs(w13.float().std().item() - 0.02) < 0.001
    assert not torch.equal(w13[0], w13[1])
    again = mt.random_moe_args(spec, 4, torch.bfloat16, std=0.02, seed=3)
    assert torch.equal(again[1 + list(mt.MOE_ARGS).index("w13")], w13)
