"""The pair rewrite (``moecomp.api.pair``): a router and an experts module that are siblings in a parent whose forward
also does other things, rewritten together as one ``moe_forward`` call while the parent's forward stays.

A hand-written parent (names, argument orders and output tuples spelled unlike transformers'), the transformers
families that have such layers (Gemma-4, DiffusionGemma), and parents the rewrite must refuse: one that transforms the
router's outputs before the experts, one whose router the spec cannot express. Every comparison: fresh random inputs,
the original module on the same inputs, outputs poisoned first where the op writes them, fp32, 1e-4 relative to the
output's largest value (``policy.VERIFY_TOLERANCE``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moecomp
from moecomp.core.reject import RejectCode
from moecomp.coverage.families import OpCounter

TOL = 1e-4
H, E, K, I = 32, 8, 2, 16


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class Selector(nn.Module):
    """A router: weightless RMS norm, a per-channel gain, a constant, softmax, top-k, renormalised, times a
    per-expert multiplier; returns (ids, weights) (two outputs, ids first)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, E, bias=False)
        self.gain = nn.Parameter(torch.ones(H))
        self.per_e = nn.Parameter(torch.ones(E))

    def forward(self, r):
        rf = r.float()
        n = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(r.dtype)
        p = self.lin(n * self.gain * 0.25).float().softmax(-1)
        w, i = p.topk(K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return i, w * self.per_e[i]


class Bank(nn.Module):
    """Experts: 3-D weights [E, 2I, H] (gate rows first, then up) and [E, H, I]; called (x, weights, ids)."""

    def __init__(self):
        super().__init__()
        self.fused_in = nn.Parameter(torch.randn(E, 2 * I, H) * 0.2)
        self.fused_out = nn.Parameter(torch.randn(E, H, I) * 0.2)

    def forward(self, x, w, ids):
        out = torch.zeros_like(x)
        for e in range(E):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(x[tok], self.fused_in[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.fused_out[e])
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


class Layer(nn.Module):
    """A parent: a mixer, a dense branch, the router reading the residual, the experts a normed copy of it."""

    def __init__(self, transform=None):
        super().__init__()
        self.mix = nn.Linear(H, H)
        self.dense = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        self.pick = Selector()
        self.bank = Bank()
        self.norm_in = nn.LayerNorm(H)
        self.transform = transform

    def forward(self, x):
        res = x + self.mix(x)
        flat = res.reshape(-1, H)
        ids, w = self.pick(flat)
        if self.transform is not None:
            ids, w = self.transform(ids, w)
        moe = self.bank(self.norm_in(flat), w, ids).reshape(res.shape)
        return res + self.dense(res) + moe


class Model(nn.Module):
    def __init__(self, n=2, transform=None):
        super().__init__()
        self.layers = nn.ModuleList(Layer(transform) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _randomise(model):
    """Give the constant vectors (fresh ones) random values: the rewrite must carry them, not their init."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gain", "per_e")):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def test_hand_written_parent_rewritten_whole():
    torch.manual_seed(0)
    model = Model().eval()
    _, rep = moecomp.optimize(model, report=True)
    by = {b.name: b for b in rep.blocks}
    assert set(by) == {"layers.0", "layers.1"}
    for b in by.values():
        assert (b.status, b.method) == ("rewritten", "pair"), (b.status, b.reason, b.notes)
        s = b.spec
        assert (s.router_input, s.router_norm, s.router_in_scale, s.expert_scale, s.activation, s.gate_up) == (
            True, True, True, True, "silu", "concat")
        assert s.router_in_const == 0.25 and abs(s.router_norm_eps - 1e-6) < 1e-7
    _randomise(model)  # after optimize: the op reads the live tensors
    ref = Model().eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 7, H)
    with torch.no_grad(), OpCounter() as c:
        out = model(x)
        want = ref(x)
    assert c.calls == 2  # one moe_forward per layer call
    assert rel_err(out, want) < TOL
    moecomp.unoptimize(model)
    assert "forward" not in model.layers[0].pick.__dict__ and "forward" not in model.layers[0].bank.__dict__
    with torch.no_grad(), OpCounter() as c:
        assert rel_err(model(x), want) < TOL
    assert c.calls == 0


def test_hooks_and_grad_run_the_originals():
    """A forward hook on the router (how transformers records router logits), or gradients: the stand-ins run the
    original forwards, the parent's output unchanged."""
    torch.manual_seed(1)
    model = Model(n=1).eval()
    moecomp.optimize(model)
    ref = Model(n=1).eval()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 5, H)
    seen = []
    h = model.layers[0].pick.register_forward_hook(lambda m, a, o: seen.append(o))
    with torch.no_grad(), OpCounter() as c:
        out = model(x)
    h.remove()
    assert c.calls == 0 and len(seen) == 1 and seen[0][0].shape == (10, K)
    assert rel_err(out, ref(x).detach()) < TOL
    out = model(x)  # grad mode, parameters require grad: the original forwards, exact gradients
    out.sum().backward()
    assert model.layers[0].bank.fused_in.grad is not None


def test_transformed_router_outputs_refused():
    """A parent that changes the router's weights before the experts: refused with a reason (the experts-only
    rewrite does not apply to a hand-written experts module either)."""
    model = Model(n=1, transform=lambda ids, w: (ids, w * 0.5)).eval()
    _, rep = moecomp.optimize(model, report=True)
    b = rep.blocks[0]
    assert b.status == "skipped"
    assert RejectCode.UNSUPPORTED_STRUCTURE in b.codes
    assert any("transforms the router's outputs before the experts" in n for n in b.notes), b.notes
    assert "forward" not in model.layers[0].pick.__dict__


def test_unexpressible_router_refused():
    """A router whose top-k reads scores the spec has no form for (softmax of the squared logits): refused saying
    no routing fits; the parent unchanged."""
    class Squared(Selector):
        def forward(self, r):
            p = self.lin(r).pow(2).softmax(-1)
            w, i = p.topk(K, dim=-1)
            return i, w

    model = Model(n=1).eval()
    model.layers[0].pick = Squared()
    _, rep = moecomp.optimize(model, report=True)
    b = rep.blocks[0]
    assert b.status == "skipped" and RejectCode.UNSUPPORTED_ROUTING in b.codes, (b.status, b.codes, b.notes)
    assert any("no routing the spec expresses" in n for n in b.notes)


@pytest.mark.families
@pytest.mark.parametrize("family", ["gemma4", "diffusion_gemma"])
def test_families_rewritten_whole(family):
    """transformers' Gemma-4 and DiffusionGemma: every decoder layer's router and experts rewritten as one op call
    (the coverage check: whole-model logits within 1e-4, one moe_forward per layer call)."""
    from moecomp.coverage import families as F

    r = F.check_family(family)
    assert (r.status, r.calls_ok) == ("equal", True), (r.status, r.reason)
    assert r.rewritten == r.blocks >= 1 and r.experts_only == 0
    assert "own input rms" in r.router and "×s[e]" in r.router


def test_compiled_parent_runs_the_op():
    """torch.compile through the stand-ins: one moe_forward per layer in the whole graph (fullgraph), no top-k, the
    same output as the original model."""
    torch.manual_seed(2)
    model = Model().eval()
    moecomp.optimize(model)
    _randomise(model)
    ref = Model().eval()
    ref.load_state_dict(model.state_dict())
    targets = []

    def backend(gm, example):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    x = torch.randn(2, 6, H)
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        want = ref(x)
    assert sum("moe_forward" in t for t in targets) == 2 and not any("topk" in t for t in targets)
    assert rel_err(out, want) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma4", "diffusion_gemma"])
def test_families_bf16_cuda(family):
    """bf16 on the GPU: the tiny model optimized on CUDA (pairs verified there), one moe_forward per layer call, and
    its logits as close to the fp32 model's as the untouched bf16 model's are (relative Frobenius error at most
    2x theirs + 2e-2: on a tiny random model bf16 alone moves the logits by several percent, and exact bf16 routing
    ties are broken by index here, in no set order by torch.topk)."""
    import copy

    from moecomp.coverage import families as F

    try:
        model, _ = F.build_tiny(family)
    except ImportError:
        pytest.skip(f"{family} not in this transformers")
    truth_model = copy.deepcopy(model).to("cuda").eval()
    model = model.to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(4)).cuda()

    def frob(a, b):
        return float((a - b).norm() / b.norm())

    with torch.no_grad():
        truth = F._logits(truth_model(input_ids=ids)).float()
        ref = F._logits(model(input_ids=ids)).float().clone()
    _, rep = moecomp.optimize(model, report=True, fast_generate=False)
    pairs = [b for b in rep.blocks if (b.status, b.method) == ("rewritten", "pair")]
    # gemma4: every layer; diffusion_gemma: its layer 0 is refused by the pair verify in bf16 (on the H200 at bc7db36
    # and on CPU: every probe of it has more routing near-ties than the check may excuse; an open defect) and left
    # experts only, the refusal naming the check
    why = ("parent's output differs", "near-ties")
    assert pairs and all(b in pairs or any(w in " ".join(b.notes) for w in why) for b in rep.blocks), str(rep)
    if family == "gemma4":
        assert len(pairs) == len(rep.blocks), str(rep)
    # counted without forward hooks: hooks on the layers make the stand-ins run the originals (by design)
    c = F.OpCounter()
    with c, torch.no_grad():
        out = F._logits(model(input_ids=ids)).float()
    assert c.calls == len(pairs) and c.experts_calls == len(rep.blocks) - len(pairs), (c.calls, c.experts_calls)
    assert torch.isfinite(out).all()
    assert frob(out, truth) <= 2 * frob(ref, truth) + 2e-2, (frob(out, truth), frob(ref, truth))
