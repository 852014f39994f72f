"""The FX pass on hash-routed blocks (``MoESpec.hash_routing``; DeepSeek-V4's HF form is in tests/hf/test_deepseek_v4.py),
written here in plain PyTorch in other spellings: the ids an ``F.embedding`` / ``index_select`` lookup of a [V, k]
table by a forward argument named neither ``input_ids`` nor ``token_ids``, the weights the softmax (or sigmoid)
scores gathered there, experts gathered per pair (``w[ids]``, ``bmm``). The pass reads the lookup by meaning and the
numeric check proves it on random token ids (a block that dispatches by other ids than it weights is refused); the
rewritten graph passes the token-id input to the op (fresh ids, same graph); whole-model graphs (the compile
backend's view: the ids a call input the embedding also reads) are rewritten too; ``match_block`` (the retry of
a capture with probe token ids) and the binder (the forward argument passed through, its absence falling back).

Tolerance: fp32, 1e-5 relative to the block's output (one op against the same math; no routing ties: the table
chooses)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moecomp
from moecomp.api import backend
from moecomp.recognise.capture import DetectError, capture_block, detect_block
from moecomp.bind.bind import bound_tensors
from moecomp.core.match import forward_arg
from moecomp.core.args import MOE_ARGS, OP_ARGS
from moecomp.recognise.fx import detect_moe as dm
from moecomp.recognise.fx.rewrite_moe import rewrite_moe
from moecomp.recognise.recognise import match_block

H, I, E, K, V = 32, 24, 6, 2, 19
TOL = 1e-5


class Experts(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, generator=g) / math.sqrt(H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I, generator=g) / math.sqrt(I))

    def forward(self, x, ids, w):
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(K, dim=0)  # [T * K, H]
        h = torch.bmm(xs.unsqueeze(1), self.gate_up_proj[flat].transpose(1, 2)).squeeze(1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.down_proj[flat].transpose(1, 2)).squeeze(1)
        return (y.view(-1, K, H) * w.unsqueeze(-1)).sum(1)


class HashMoE(nn.Module):
    """out = sum_k w * expert_{table[tok], k}(x), w = softmax(router x)[ids] renormalised (``form``: how the table is
    read, and what goes wrong on purpose)."""

    def __init__(self, form: str = "embedding", seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.form = form
        self.gate = nn.Linear(H, E, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(E, H, generator=g) / math.sqrt(H) * 2)
        self.register_buffer("table", torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
        self.bias = nn.Parameter(torch.randn(E, generator=g) * 0.1)
        self.experts = Experts(g)

    def forward(self, hidden, tokens=None):
        shape = hidden.shape
        x = hidden.reshape(-1, H)
        tok = tokens.reshape(-1)
        if self.form == "index_select":
            scores = torch.sigmoid(self.gate(x))
            ids = self.table.index_select(0, tok)
        else:
            scores = torch.softmax(self.gate(x), dim=-1)
            ids = F.embedding(tok, self.table)
        if self.form == "bias":  # a correction bias on scores that choose nothing: no spec says what it means
            scores = scores + self.bias
        w = scores.gather(1, ids)
        w = w / w.sum(-1, keepdim=True)
        if self.form == "wrong_dispatch":  # weights at the table's ids, experts of other ids
            ids = (ids + 1) % E
        return self.experts(x, ids, w).view(shape)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _tok(shape, seed):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", ["embedding", "index_select"])
def test_hash_lookup_is_read_and_proven(poison, form):
    block = HashMoE(form).eval()
    m = detect_block(block, torch.randn(2, 5, H), call_args={"tokens": _tok((2, 5), 0)})
    s = m.spec
    assert (s.hash_routing, s.top_k, s.num_experts, s.renormalize, s.has_correction_bias) == (True, K, E, True, False)
    assert s.scoring == ("sigmoid" if form == "index_select" else "softmax"), s.describe()
    assert m.bindings["hash_table"] == "table" and m.bindings["token_ids"] == forward_arg("tokens")
    assert m.verified.startswith("numeric"), m.verified
    x, tok = torch.randn(3, 7, H), _tok((3, 7), 1)  # fresh tokens and ids
    t = bound_tensors(block, s, m.bindings, m.derived, {"tokens": tok})
    assert t[OP_ARGS.index("hash_table")] is block.table and t[OP_ARGS.index("token_ids")] is tok
    n = len(MOE_ARGS)
    with torch.no_grad():
        got, want = torch.ops.moecomp.moe_forward(x, *t[:n], s.key, *t[n:]), block(x, tok)
    assert rel(got, want) <= TOL


@pytest.mark.parametrize("form,why", [("wrong_dispatch", "numeric check failed"), ("bias", "no choice")])
def test_unsupported_forms_are_refused(form, why):
    with pytest.raises(DetectError) as e:
        detect_block(HashMoE(form).eval(), torch.randn(2, 5, H), call_args={"tokens": _tok((2, 5), 0)})
    assert why in e.value.reason, e.value.reason
    assert any(w.startswith("hash lookup") for w, _ in e.value.rejected), e.value.rejected


def test_rewritten_graph_reads_the_token_ids():
    """The token ids are an input of the rewritten graph (passed to the op), not a constant of the trace: new ids
    give the block's new result from the same graph."""
    block = HashMoE().eval()
    cap = capture_block(block, torch.randn(2, 5, H), call_args={"tokens": _tok((2, 5), 0)})
    res = dm.detect_moe(cap.gm, cap.example_inputs)
    assert len(res.matches) == 1
    gm, inputs = cap.gm, cap.concrete_inputs()
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    tok_i = names.index(res.matches[0].bindings["token_ids"])
    x_i = [cap.paths[n] for n in names].index("<input>")
    with torch.no_grad():
        assert rewrite_moe(gm, res.matches) == 1
        for seed in (3, 4):
            inputs[tok_i] = _tok((2, 5), seed)
            got = gm(*inputs)
            got = got[0] if isinstance(got, (tuple, list)) else got
            assert rel(got, block(inputs[x_i], inputs[tok_i])) <= TOL
    assert [dm.op_name(n) for n in gm.graph.nodes].count("moe_forward") == 1


class Model(nn.Module):
    """Embedding, a hash-routed block reading the model's token ids, a norm: the compile backend's whole graph."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.mlp = HashMoE()
        self.norm = nn.LayerNorm(H)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        return self.norm(h + self.mlp(h, tokens=input_ids))


def test_whole_model_graph(poison):
    model = Model().eval()
    seen = []

    def be(gm, example_inputs):
        seen.append(backend.run_passes(gm, example_inputs, count=False))
        return gm.forward

    compiled = torch.compile(model, backend=be, dynamic=False)
    with torch.no_grad():
        for seed in (5, 6):  # the second call reuses the graph with other ids
            ids = _tok((2, 6), seed)
            assert rel(compiled(ids), model(ids)) <= TOL
    assert len(seen) == 1 and len(seen[0].matches) == 1 and seen[0].replaced == 1
    assert seen[0].matches[0].spec.hash_routing


def test_match_block_and_bind(poison):
    """``match_block``: the capture from the hidden states alone fails (tokens=None), the retry with probe token ids
    as ``tokens`` is read as hash routing and verified. Bound, the block passes its ``tokens`` to the op; without
    them it runs its original forward (which needs them: it raises as before)."""
    block = HashMoE().eval()
    v = match_block(block)
    assert v.match.spec.hash_routing and v.match.bindings["token_ids"] == forward_arg("tokens")
    assert v.max_rel_err <= TOL
    model = Model().eval()
    ref = copy.deepcopy(model)
    _, rep = moecomp.optimize(model, report=True)
    assert [b.name for b in rep.rewritten] == ["mlp"] and rep.rewritten[0].method == "fx", str(rep)
    ids = _tok((2, 6), 9)
    from moecomp.coverage import families as fam

    with torch.no_grad():
        out, per, total = fam.count_calls_per_block(model, lambda: model(ids))
        assert per == {"mlp": 1} and total == 1 and rel(out, ref(ids)) <= TOL
        with pytest.raises(AttributeError):  # no token ids: the original forward, which reads them
            model.mlp(torch.randn(4, H))
    assert model.mlp._moecomp.fallbacks == 1


def test_bad_table_is_refused():
    """A table entry outside [0, E) is refused by the pass before any check runs (``SPEC_INVALID``, naming
    hash_table; the block itself would index out of range). The binder checks the whole table too
    (``hash_routing.check_table``, tests/ops/test_hash_routing.py)."""
    from moecomp.core.reject import RejectCode

    block = HashMoE().eval()
    with torch.no_grad():
        block.table[3, 0] = E
    with pytest.raises(DetectError) as e:
        detect_block(block, torch.randn(2, 5, H), call_args={"tokens": _tok((2, 5), 0)})
    (why,) = [r for w, r in e.value.rejected if w.startswith("hash lookup")]
    assert why.code is RejectCode.SPEC_INVALID and "hash_table" in why.message and "[0, 6)" in why.message, why
