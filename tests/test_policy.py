"""moecomp.core.policy holds every tolerance / near-tie / probe rule once; reject codes drive control flow, not text."""

from __future__ import annotations

import io
import os
import tokenize

import pytest
import torch

import moecomp
from moecomp.core import policy
from moecomp.core.reject import Reject, RejectCode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the modules that apply the policy: none may spell one of its literals itself
USERS = [
    "moecomp/api/optimize.py",
    "moecomp/recognise/fallback.py",
    "moecomp/bind/bind.py",
    "moecomp/recognise/structure.py",
    "moecomp/hf/experts_interface.py",
    "moecomp/recognise/capture.py",
    "moecomp/api/backend.py",
    "moecomp/recognise/fx/graph.py",
    "moecomp/recognise/fx/numeric.py",
    "moecomp/recognise/fx/detect_moe.py",
    "moecomp/recognise/fx/moe_routing.py",
    "moecomp/recognise/fx/moe_experts.py",
    "moecomp/recognise/fx/moe_per_expert.py",
    "moecomp/recognise/fx/moe_output.py",
    "moecomp/recognise/fx/fse.py",
    "moecomp/recognise/recognise.py",
    "moecomp/verify/verify.py",
    "moecomp/recognise/fx/rewrite_moe.py",
    "benchmarks/bench_moe.py",
    "benchmarks/layer/common.py",  # bench_moe's parts that hold its tolerances and checks
    "benchmarks/layer/checks.py",
    "benchmarks/layer/timing.py",
    "benchmarks/layer/fp8.py",
    "benchmarks/layer/fp8_paths.py",
]
# tolerance / tie-window literals (as written) that belong in policy.py only
FORBIDDEN = {"1e-4", "1e-6", "1e-5", "2e-5", "1e-2", "2e-2", "3e-2", "0.125", "2.0**-7", "2.0**-10", "2**-7",
             "2**-10"}


def _code_literals(path: str) -> set[str]:
    """Number literals in code (comments and strings, docstrings included, are not code), with ``a**-b`` joined."""
    with open(os.path.join(ROOT, path)) as f:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(f.read()).readline)
                if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    out = set()
    for i, t in enumerate(toks):
        if t.type != tokenize.NUMBER:
            continue
        out.add(t.string)
        if i + 3 < len(toks) and toks[i + 1].string == "**" and toks[i + 2].string == "-":
            out.add(f"{t.string}**-{toks[i + 3].string}")
    return out


@pytest.mark.parametrize("path", USERS)
def test_no_policy_literal_outside_policy(path):
    dup = _code_literals(path) & FORBIDDEN
    assert not dup, f"{path} spells {sorted(dup)}: import it from moecomp.core.policy instead"


def test_policy_defines_each_value():
    lits = _code_literals("moecomp/core/policy.py")
    for v in ("1e-4", "3e-2", "1e-2", "1e-6", "2.0**-7", "2.0**-10", "0.125"):
        assert v in lits
    # the values themselves (unchanged by the move to policy.py)
    assert policy.VERIFY_TOLERANCE == {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 3e-2,
                                       torch.float16: 1e-2}
    assert policy.verify_tolerance(torch.float8_e4m3fn) == 1e-2
    assert policy.TIE_REL == {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
    assert policy.tie_window(torch.float32) is None
    assert policy.max_tie_tokens(32) == 4 and policy.max_tie_tokens(4) == 1
    assert policy.PROBE_SHAPE == (2, 16) and policy.PROBE_SEED == 0


def test_users_read_the_policy():
    import importlib

    opt = importlib.import_module("moecomp.api.optimize")  # (moecomp.optimize is also the function)
    ei = importlib.import_module("moecomp.hf.experts_interface")

    assert opt.TOLERANCE is policy.VERIFY_TOLERANCE and opt.TIE_REL is policy.TIE_REL
    assert not hasattr(ei, "TOLERANCE")
    x = policy.probe_input(8, "cpu", torch.float32)
    assert x.shape == (*policy.PROBE_SHAPE, 8)
    g = torch.Generator().manual_seed(policy.PROBE_SEED)
    assert torch.equal(x, torch.randn(*policy.PROBE_SHAPE, 8, generator=g))


def test_bench_tie_window_values():
    l = torch.tensor([[1.0, -3.0, 0.5]])
    assert torch.allclose(policy.bench_tie_window(l, True), 2e-5 * (1.0 + l.abs()))
    _, e = torch.frexp(l)
    assert torch.equal(policy.bench_tie_window(l, False), 0.5 * torch.pow(2.0, (e - 8).float()) + 1e-30)


# ------------------------------------------------------------------------------------------------ reject codes
def test_reject_is_frozen_text():
    r = Reject(RejectCode.GRAD_MODE, "grad mode is on")
    assert str(r) == "grad mode is on"
    with pytest.raises(Exception):
        r.code = RejectCode.META_TENSORS  # type: ignore[misc]


def test_detect_error_codes():
    from moecomp.recognise.capture import DetectError

    assert DetectError("x", "capture").code is RejectCode.CAPTURE_FAILED
    assert DetectError("x").code is RejectCode.NOT_RECOGNISED
    with pytest.raises(ValueError):
        DetectError("x", "dynamo")


def test_capture_failure_is_read_from_the_code_not_the_text(monkeypatch):
    """The pipeline hands a block to the attribute reader when the FX pass's Reject says CAPTURE_FAILED, whatever
    its text says, and returns any other Reject as it is."""
    from moecomp.recognise import recognise as R
    from moecomp.coverage import families as F
    from moecomp.recognise.structure import iter_blocks
    from moecomp.core.match import Match

    model, _ = F.build_tiny("mixtral")
    _, block, parts, _ = iter_blocks(model)[0]
    x = torch.randn(2, 16, parts.hidden_size)
    monkeypatch.setattr(R, "_detect_fx", lambda *a: Reject(RejectCode.CAPTURE_FAILED, "no MoE recognised"))
    got, notes = R.recognise(block, parts, x)
    assert isinstance(got, Match) and got.method == "fallback" and "attribute fallback used" in notes[0]
    monkeypatch.setattr(R, "_detect_fx", lambda *a: Reject(RejectCode.NOT_RECOGNISED, "Dynamo could not capture"))
    got, _ = R.recognise(block, parts, x)
    assert isinstance(got, Reject) and got.code is RejectCode.NOT_RECOGNISED
    got, notes = R.recognise(block, parts, x, trust_fallback=True)
    assert isinstance(got, Match) and got.method == "fallback" and "trust_fallback" in notes[0]


def test_backend_counts_grad_mode_by_code(monkeypatch):
    """``skipped_autograd`` counts GRAD_MODE rejects, whatever their text says (and not other rejections)."""
    from types import SimpleNamespace

    from moecomp.api import backend

    res = SimpleNamespace(matches=[], replaced=0, fused={},
                          rejected=[("a", "reworded: gradients needed"), ("b", "grad mode is on, but not ours")],
                          rejects=[("a", Reject(RejectCode.GRAD_MODE, "reworded: gradients needed"))])
    before = moecomp.counters["backend"]["skipped_autograd"]
    gm = SimpleNamespace(code="")
    monkeypatch.setattr(backend, "last_results", [])
    backend._count(gm, res)
    assert moecomp.counters["backend"]["skipped_autograd"] == before + 1


def test_fallback_error_codes():
    from moecomp.recognise.fallback import FallbackError

    assert FallbackError("x").code is RejectCode.UNSUPPORTED_STRUCTURE
    assert FallbackError("x", RejectCode.VERIFICATION_FAILED).code is RejectCode.VERIFICATION_FAILED


def test_report_codes_and_meta_warning():
    """Meta blocks: the warning is driven by RejectCode.META_TENSORS; the report text is unchanged."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moecomp.api.optimize import META_NOTE

    cfg = Qwen3MoeConfig(num_hidden_layers=2, hidden_size=64, moe_intermediate_size=32, intermediate_size=64,
                         num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=128)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    with pytest.warns(UserWarning, match="meta tensors"):
        _, rep = moecomp.optimize(model, report=True)
    assert len(rep.blocks) == 2
    for b in rep.blocks:
        assert RejectCode.META_TENSORS in b.codes and META_NOTE in b.notes
        assert "meta_tensors" in b.to_dict()["codes"]
    assert "meta_tensors" not in str(rep)


def test_skipped_block_has_a_code():
    """A block refused for its structure carries the code next to the unchanged reason text."""
    from torch import nn

    from moecomp.api.optimize import BlockReport, _process_block

    rep = BlockReport(name="", cls="X", status="skipped")
    rep.refuse(RejectCode.UNSUPPORTED_ROUTING, "hash routing")
    assert rep.reason == "hash routing" and rep.codes == [RejectCode.UNSUPPORTED_ROUTING]
    assert rep.to_dict()["codes"] == ["unsupported_routing"]
    r = _process_block("m", nn.Linear(2, 2), None, "no router", None, False)
    assert r.status == "skipped" and r.reason == "no router" and r.codes == [RejectCode.NOT_A_BLOCK]


def test_experts_only_refusal_carries_its_code():
    """Experts with a gate no spec activation computes (``test_new_styles.odd_gate_model``): the block is left alone,
    and besides the whole block's code its report carries the experts-only path's (read by code, not from the
    text). (muse_spark and inkling2 were the examples before their features joined the spec.)"""
    pytest.importorskip("transformers.models.inkling2.modeling_inkling2")  # (not in transformers 5.17)
    from tests.hf.test_new_styles import odd_gate_model

    model = odd_gate_model()
    _, rep = moecomp.optimize(model, report=True)
    assert rep.blocks and all(b.status == "skipped" for b in rep.blocks)
    assert all(RejectCode.UNSUPPORTED_STRUCTURE in b.codes[1:] for b in rep.blocks), [b.codes for b in rep.blocks]
    assert all("experts only not possible" in b.reason for b in rep.blocks)
