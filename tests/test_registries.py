"""The two registries of strategies (issue 40): the rewrites ``optimize`` tries on a block
(``moecomp.api.rewrites.REWRITES``) and the recognisers a block goes through (``moecomp.recognise.recognise.
RECOGNISERS``), their counters in ``moecomp.counters``, and the block status enum (``moecomp.core.status``).

* Each registry holds the documented order (its module's docstring, docs/ARCHITECTURE.md and core/counters.py name
  the strategies in that order).
* The counters count exactly: tiny models (fp32, CPU) whose every block goes one way (whole by the FX pass, whole by
  the attribute reader, experts only, the FX pass tracing with real values, the dispatch reader), counted once per
  block under that strategy's name and under no other.
* A strategy registered by a user is walked in its place and counts under its name; unregistered, it is gone; bad
  names are a ValueError naming the argument.
* ``BlockStatus`` equals, hashes, formats and serialises as its text: reports and their JSON read as before.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.api import rewrites as RW  # noqa: E402
from moecomp.api.report import BlockReport, Report  # noqa: E402
from moecomp.core.reject import Reject, RejectCode  # noqa: E402
from moecomp.core.status import BlockStatus  # noqa: E402
from moecomp.coverage import families as F  # noqa: E402
from moecomp.recognise import fallback  # noqa: E402

R = importlib.import_module("moecomp.recognise.recognise")  # (the module: ``recognise`` is also its function)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWRITE_ORDER = ("sharded", "whole", "pair", "experts_only")
RECOGNISE_ORDER = ("fx", "fx_real_values", "dispatch_reader", "attribute_reader")


@pytest.fixture(autouse=True)
def _quiet_single_thread(quiet_single_thread):
    """Quiet and single-threaded (tests/conftest.py); counters and Dynamo fresh for each test."""
    torch._dynamo.reset()
    moecomp.counters.clear()
    yield
    moecomp.counters.clear()


@pytest.fixture(scope="module")
def mixtral():
    return F.build_tiny("mixtral", seed=0)[0]


def _counts() -> tuple[dict, dict]:
    snap = moecomp.counters.snapshot()
    return {k: v for k, v in snap.get("rewrite", {}).items() if v}, {
        k: v for k, v in snap.get("recognise", {}).items() if v}


def _in_order(text: str, names) -> bool:
    at = [text.find(n) for n in names]
    return all(i >= 0 for i in at) and at == sorted(at)


# ------------------------------------------------------------------------------------------------------ the order
def test_registries_hold_the_documented_order():
    assert RW.REWRITES.names() == REWRITE_ORDER
    assert R.RECOGNISERS.names() == RECOGNISE_ORDER
    assert [type(s).__name__ for s in RW.REWRITES] == ["Sharded", "WholeBlock", "Pair", "ExpertsOnly"]
    assert [type(s).__name__ for s in R.RECOGNISERS] == ["FxPass", "FxRealValues", "DispatchReader",
                                                         "AttributeReader"]
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        arch = f.read()
    section = arch[arch.index("### The two registries"):]
    section = section[:section.index("\n#", 1)]
    from moecomp.core import counters as C

    for names, docs in ((REWRITE_ORDER, (RW.__doc__, section, C.__doc__)),
                        (RECOGNISE_ORDER, (R.__doc__, section, C.__doc__))):
        for text in docs:  # (each names them in one spelling: a list, quoted keys, or code)
            assert any(_in_order(text, [form.format(n) for n in names]) for form in (
                "    {} ", "{}: ", '"{}"', "`{}`")), (names, text[:200])


# ------------------------------------------------------------------------------------------------------ counters
def test_whole_blocks_by_the_fx_pass_are_counted(mixtral):
    model = copy.deepcopy(mixtral)
    _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    assert [b.status for b in rep.blocks] == [BlockStatus.REWRITTEN] * 2, str(rep)
    assert _counts() == ({"whole": 2}, {"fx": 2})
    moecomp.counters.clear()
    moecomp.scan(copy.deepcopy(mixtral))  # scan recognises (counted) and rewrites nothing
    assert _counts() == ({}, {"fx": 2})


def test_attribute_reader_is_counted(mixtral):
    _, rep = moecomp.optimize(copy.deepcopy(mixtral), report=True, use_capture=False, fast_generate=False)
    assert [(b.status, b.method) for b in rep.blocks] == [("rewritten", "fallback")] * 2, str(rep)
    assert _counts() == ({"whole": 2}, {"attribute_reader": 2})


def test_experts_only_is_counted():
    """zaya's blocks have no router weight the recognisers read: the experts-only rewrite takes both."""
    model = F.build_tiny("zaya", seed=0)[0]
    _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    assert [b.status for b in rep.blocks] == ["experts only"] * 2, str(rep)
    rewrite, _ = _counts()
    assert rewrite == {"experts_only": 2}


def _spelling(module: str, name: str):
    """A block of tests/passes' spellings, redrawn as test_per_expert_spellings does."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "passes"))
    try:
        pb, mod = importlib.import_module("per_expert_blocks"), importlib.import_module(module)
    finally:
        sys.path.pop(0)
    return torch.nn.Sequential(pb._redraw(mod.SPELLINGS[name](), 0)).eval()


@pytest.fixture
def real_parameter_values(monkeypatch):
    """As in tests/passes/test_per_expert_spellings.py: real-value capture copies Parameters' values too."""
    import torch._subclasses.meta_utils as meta_utils

    orig = meta_utils._safe_copy
    monkeypatch.setattr(meta_utils, "_safe_copy",
                        lambda dst, src: orig(dst, src.detach() if isinstance(src, torch.nn.Parameter) else src))


@pytest.mark.parametrize("module, name, counted", [
    ("sorted_spellings", "skip_empty_continue", "fx_real_values"),  # ``if tok.numel() == 0: continue``
    ("per_expert_spellings", "skip_empty", "dispatch_reader"),  # ``if counts[e] == 0``: not captured
])
def test_loop_blocks_are_counted_by_their_reader(real_parameter_values, module, name, counted):
    _, rep = moecomp.optimize(_spelling(module, name), report=True, fast_generate=False)
    assert [b.status for b in rep.blocks] == ["rewritten"], str(rep)
    assert _counts() == ({"whole": 1}, {counted: 1})


# ------------------------------------------------------------------------------------------------------ custom
class _Claim(RW.Rewrite):
    """Settles every block it is asked about as supported (a stand-in for a user's rewrite), and records them."""

    name = "claim"

    def __init__(self):
        self.seen = []

    def applies(self, ctx):
        return ctx.parts is not None

    def run(self, ctx):
        self.seen.append(ctx.name)
        ctx.rep.status, ctx.rep.method, ctx.rep.reason = BlockStatus.SUPPORTED, "claim", ""


def test_custom_rewrite_registered_and_removed(mixtral):
    claim = _Claim()
    RW.REWRITES.register(claim, before="whole")
    try:
        assert RW.REWRITES.names() == ("sharded", "claim", "whole", "pair", "experts_only")
        _, rep = moecomp.optimize(copy.deepcopy(mixtral), report=True, fast_generate=False)
        assert [(b.status, b.method) for b in rep.blocks] == [("supported", "claim")] * 2, str(rep)
        assert claim.seen == [b.name for b in rep.blocks] and _counts() == ({}, {})  # whole never tried
        with pytest.raises(ValueError, match="already registered"):
            RW.REWRITES.register(_Claim())
    finally:
        assert RW.REWRITES.unregister("claim") is claim
    assert RW.REWRITES.names() == REWRITE_ORDER
    RW.REWRITES.register(claim)  # last: asked only about blocks nothing else settled (none here)
    try:
        _, rep = moecomp.optimize(copy.deepcopy(mixtral), report=True, fast_generate=False)
        assert [b.status for b in rep.blocks] == ["rewritten"] * 2 and claim.seen == [b.name for b in rep.blocks]
    finally:
        RW.REWRITES.unregister("claim")
    with pytest.raises(ValueError, match="before must name a registered rewrite"):
        RW.REWRITES.register(claim, before="nothing")
    with pytest.raises(ValueError, match="name must be a registered rewrite"):
        RW.REWRITES.unregister("claim")
    with pytest.raises(ValueError, match="non-empty str name"):
        RW.REWRITES.register(RW.Rewrite())
    assert RW.REWRITES.names() == REWRITE_ORDER


class _Attributes(R.Recogniser):
    """A user's recogniser: the attribute reader under another name, tried before the FX pass."""

    name = "mine"

    def applies(self, a):
        return a.x is not None

    def run(self, a):
        return fallback.recognise(a.block, a.parts, a.x)


class _Refuse(R.Recogniser):
    name = "refuse"

    def applies(self, a):
        return True

    def run(self, a):
        return Reject(RejectCode.NOT_RECOGNISED, "refused by a test recogniser")


def test_custom_recogniser_registered_and_removed(mixtral):
    R.RECOGNISERS.register(_Attributes(), before="fx")
    try:
        _, rep = moecomp.optimize(copy.deepcopy(mixtral), report=True, fast_generate=False)
        assert [(b.status, b.method) for b in rep.blocks] == [("rewritten", "fallback")] * 2, str(rep)
        assert _counts() == ({"whole": 2}, {"mine": 2})  # the FX pass never ran
    finally:
        R.RECOGNISERS.unregister("mine")
    assert R.RECOGNISERS.names() == RECOGNISE_ORDER
    saved = [R.RECOGNISERS.unregister(n) for n in RECOGNISE_ORDER]  # only a refusing recogniser left
    R.RECOGNISERS.register(_Refuse())
    pair = RW.REWRITES.unregister("pair")  # (the whole block's refusal alone)
    try:
        rep = moecomp.scan(copy.deepcopy(mixtral), experts_only=False)
        assert [(b.status, b.reason, b.codes) for b in rep.blocks] == [
            ("skipped", "refused by a test recogniser", [RejectCode.NOT_RECOGNISED])] * 2, str(rep)
    finally:
        R.RECOGNISERS.unregister("refuse")
        for s in saved:
            R.RECOGNISERS.register(s)
        RW.REWRITES.register(pair, before="experts_only")
    assert R.RECOGNISERS.names() == RECOGNISE_ORDER and RW.REWRITES.names() == REWRITE_ORDER
    assert _counts() == ({"whole": 2}, {"mine": 2})  # (the scan with the refusing one counted nothing)


# ------------------------------------------------------------------------------------------------------ status
def test_status_is_an_enum_that_reads_as_its_text():
    assert {s.value for s in BlockStatus} == {"rewritten", "skipped", "supported", "unverified", "already",
                                               "experts only", "experts only supported"}
    for s in BlockStatus:
        assert s == s.value and hash(s) == hash(s.value) and {s.value: 1}[s] == 1
        assert str(s) == f"{s}" == "%s" % s == s.value and f"{s:>25}" == f"{s.value:>25}"
        assert json.dumps({s: s}) == json.dumps({s.value: s.value})
    assert BlockReport(name="a", cls="X", status="skipped").status is BlockStatus.SKIPPED
    with pytest.raises(ValueError, match="status must be a BlockStatus"):
        BlockReport(name="a", cls="X", status="done")


def test_report_text_and_json_read_as_before():
    """The table and the JSON of a report whose statuses are the enum's members are those its texts gave."""
    blocks = [BlockReport(name=n, cls="X", status=s, method=m, reason=r) for n, s, m, r in (
        ("a", BlockStatus.REWRITTEN, "fx", ""), ("b", BlockStatus.SKIPPED, "", "why"),
        ("c", BlockStatus.EXPERTS_ONLY, "experts interface", "routing"), ("d", BlockStatus.SUPPORTED, "", ""))]
    rep = Report("M", blocks, "detection: x", "optimize")
    text = str(rep)
    assert "{'blocks': 4, 'rewritten': 1, 'skipped': 1, 'experts only': 1, 'supported': 1}" in text, text
    assert "BlockStatus" not in text and "BlockStatus" not in rep.to_json()
    rows = {ln.split()[0]: ln for ln in text.splitlines()[4:]}
    assert re.search(r"  rewritten \[fx\]  ", rows["a"]) and re.search(r"  skipped: why  ", rows["b"])
    assert re.search(r"  experts only: routing \[experts interface\]  ", rows["c"])
    assert re.search(r"  supported  ", rows["d"])
    d = json.loads(rep.to_json())
    assert [b["status"] for b in d["blocks"]] == ["rewritten", "skipped", "experts only", "supported"]
    assert d["summary"] == {"blocks": 4, "rewritten": 1, "skipped": 1, "experts only": 1, "supported": 1}
    assert all(type(b.to_dict()["status"]) is str for b in blocks)
    assert type(next(iter(set(rep.summary()) - {"blocks"}))) is str
    assert [b.name for b in rep.rewritten] == ["a"] and [b.name for b in rep.skipped] == ["b"]
    assert [b.name for b in rep.experts_only] == ["c"]
