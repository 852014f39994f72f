"""Routing replay on transformers' own forward (``moecomp.replay_routing``, ``moecomp.record_routing``; issue 43).

Tiny random-weight models (fp32, CPU): Mixtral (softmax, renormalised), Qwen3-MoE (softmax, no renormalisation),
Qwen2-MoE (a sigmoid-gated shared expert), DeepSeek-V3 (sigmoid, groups, correction bias, routed scaling, a shared
expert). Tolerances: logits within REPLAY_TOL = 1e-5 relative (max |diff| / max |ref|; the replay's plain-torch
experts sum in another order than transformers' grouped path), gradients within GRAD_TOL = 1e-4 relative per
parameter (max |diff| / max |ref grad|; for the ModuleList block, relative to the model's largest gradient, since an
expert no token chose has zeros); outputs NaN-poisoned (``poison``), so an unwritten element fails. A routed-scaling
factor dropped from the replay fails the DeepSeek-V3 cases (checked by hand once).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import moecomp
from moecomp.api import replay_forward as rf
from moecomp.api.routing import moe_blocks
from moecomp.core.spec import MoESpec
from moecomp.coverage import families as F
from moecomp.testing import LinearExpert

from .conftest import rel_err

REPLAY_TOL = 1e-5
GRAD_TOL = 1e-4
FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def built():
    return {fam: F.build_tiny(fam, seed=0)[0].eval() for fam in FAMILIES}


def _ids(B=2, S=5, seed=0):
    return torch.randint(3, 100, (B, S), generator=torch.Generator().manual_seed(seed))


def _record(model, ids):
    with torch.no_grad(), moecomp.record_routing(model) as rec:
        ref = model(input_ids=ids).logits
    return ref, rec


def _state(model):
    """What replay must leave as it found it: instance forwards, hooks (the model's and the global ones)."""
    mods = list(model.modules())
    return ([m.__dict__.get("forward") for m in mods], [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in
                                                        mods], len(nn.modules.module._global_forward_pre_hooks))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_model", [True, False])
def test_record_then_replay_equals_original(built, family, with_model, poison):
    model = built[family]
    ids = _ids()
    ref, rec = _record(model, ids)
    n = len(moe_blocks(model))
    assert n == model.config.num_hidden_layers  # every layer of these tiny configs is a MoE block
    routes = rec.routes
    k = rec.plans[0].spec.top_k
    assert routes.shape == (n, 2, 5, k) and routes.dtype == torch.int64 and len(rec.calls) == 1
    with torch.no_grad(), moecomp.replay_routing(routes, model if with_model else None) as ctx:
        out = model(input_ids=ids).logits
    assert len(ctx.plans) == n
    assert rel_err(out, ref) <= REPLAY_TOL


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_bf16_replay_close_to_original(built, family, poison):
    """bf16: the replay sums the experts in fp32 (transformers in bf16): logits within BF16_TOL = 2e-2 relative."""
    model = copy.deepcopy(built[family]).to(torch.bfloat16)
    ids = _ids()
    ref, rec = _record(model, ids)
    with torch.no_grad(), moecomp.replay_routing(rec.routes):
        out = model(input_ids=ids).logits
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 2e-2


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_replay_gradients_equal_original(built, family):
    ids = _ids(seed=1)
    labels = _ids(seed=2)
    a, b = copy.deepcopy(built[family]).train(), copy.deepcopy(built[family]).train()
    # Mixtral: with its load-balancing loss (transformers records the router's logits with hooks: the replay calls
    # the router module while they record)
    kw = {"output_router_logits": True} if family == "mixtral" else {}
    with moecomp.record_routing(a) as rec:
        out_a = a(input_ids=ids, labels=labels, **kw)
    ref = out_a.loss
    ref.backward()
    with moecomp.replay_routing(rec.routes):
        out_b = b(input_ids=ids, labels=labels, **kw)
        loss = out_b.loss
        loss.backward()
    if kw:
        assert out_a.aux_loss is not None and abs(out_b.aux_loss.item() - out_a.aux_loss.item()) <= REPLAY_TOL
    assert abs(loss.item() - ref.item()) <= REPLAY_TOL * abs(ref.item())
    checked = 0
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is None or not pa.grad.abs().max() > 0:
            continue
        assert rel_err(pb.grad, pa.grad) <= GRAD_TOL, (name, rel_err(pb.grad, pa.grad))
        checked += 1
    # the router's and the experts' weights of every block got gradients through the replay
    for _, block in moe_blocks(b):
        assert any(p.grad is not None and p.grad.abs().max() > 0 for p in block.parameters())
    assert checked >= 4 * len(moe_blocks(b))


def _mixtral_expected(block, x, ids):
    """Mixtral's block by hand: softmax over the experts, the scores at ``ids`` renormalised, SwiGLU experts."""
    x2 = x.reshape(-1, x.shape[-1])
    scores = (x2 @ block.gate.weight.T).softmax(-1)
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    gu, down = block.experts.gate_up_proj, block.experts.down_proj
    out = torch.zeros_like(x2)
    I = down.shape[-1]
    for t in range(x2.shape[0]):
        for j in range(ids.shape[1]):
            h = gu[ids[t, j]] @ x2[t]
            out[t] += w[t, j] * (down[ids[t, j]] @ (torch.nn.functional.silu(h[:I]) * h[I:]))
    return out.reshape(x.shape)


def test_different_routes_match_hand_computation(built, poison):
    model = built["mixtral"]
    block = model.model.layers[0].mlp
    x = torch.randn(1, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = block(x)
        with moecomp.record_routing(block) as rec:
            block(x)
        recorded = rec.routes
        E = model.config.num_local_experts
        routes = (recorded + torch.tensor([1, 3])) % E  # other experts for every token
        with moecomp.replay_routing(routes, block):
            got = block(x)
        expected = _mixtral_expected(block, x, routes[0, 0])
        by_hand = _mixtral_expected(block, x, recorded[0, 0])
    assert rel_err(got, expected) <= REPLAY_TOL
    assert rel_err(got, own) > 1e-2  # other routes, another output
    assert rel_err(by_hand, own) <= REPLAY_TOL  # the block's own routes, by hand, give its own output


def test_padding_rows_route_as_the_model(built, poison):
    model = built["deepseek_v3"]
    ids = _ids()
    ref, rec = _record(model, ids)
    routes = rec.routes.clone()
    routes[:, 1, 2:] = -1  # the second sequence's last tokens: padding
    with torch.no_grad(), moecomp.replay_routing(routes):
        out = model(input_ids=ids).logits
    assert rel_err(out, ref) <= REPLAY_TOL
    with torch.no_grad(), moecomp.replay_routing(torch.full_like(routes, -1)):
        out = model(input_ids=ids).logits
    assert rel_err(out, ref) <= REPLAY_TOL


def test_bad_routes(built):
    model = built["mixtral"]
    ids = _ids()
    _, rec = _record(model, ids)
    r = rec.routes
    cases = [
        (r[:1], "expected 2 layers"),
        (r[..., :1], "expected k = 2"),
        (torch.full_like(r, 8), r"expected ids in \[0, 8\)"),
        (r[:, :1], "expected batch 2 and tokens 5"),
        (r[:, :, :3], "expected batch 2 and tokens 5"),
    ]
    for bad, msg in cases:
        for target in (model, None):
            with pytest.raises(ValueError, match=msg), torch.no_grad(), moecomp.replay_routing(bad, target):
                model(input_ids=ids)
    before = _state(model)
    for bad, msg in [(r.float(), "expected an integer tensor"), (r[0], "expected an integer tensor"),
                     (r - 2, "expected expert ids >= 0"), ([[1]], "expected a tensor")]:
        with pytest.raises(ValueError, match=msg):
            moecomp.replay_routing(bad)
    mixed = r.clone()
    mixed[0, 0, 0, 0] = -1
    with pytest.raises(ValueError, match="all -1"):
        moecomp.replay_routing(mixed)
    with pytest.raises(ValueError, match="expected a torch.nn.Module"):
        moecomp.record_routing("model")
    assert _state(model) == before


def test_refused_features():
    base = dict(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    assert rf.refusals(MoESpec(**base)) == []
    assert rf.refusals(MoESpec(**base, scoring="sigmoid", n_group=2, topk_group=1, has_correction_bias=True,
                               routed_scaling_factor=2.5)) == []
    assert "expert capacity" in rf.refusals(MoESpec(**base, capacity=3))[0]
    assert "zero experts" in rf.refusals(MoESpec(**base, zero_experts=2))[0]
    assert "latent experts" in rf.refusals(MoESpec(**base, latent_size=4))[0]
    assert "sparsemixer" in rf.refusals(MoESpec(**base, score_order="sparsemixer"))[0]


def test_refused_block_names_block_and_why(built, monkeypatch):
    """A block the replay cannot run is a ValueError naming the block and why (an optimized model replays on the op
    path: tests/hf/test_routing_op.py; here the op's sparsemixer refusal, faked on a bound block's spec)."""
    model = copy.deepcopy(built["qwen3_moe"])
    moecomp.optimize(model, fast_generate=False)
    st = moe_blocks(model)[1][1]._moecomp
    monkeypatch.setattr(st, "op_spec", st.spec.replace(score_order="sparsemixer"))
    monkeypatch.setattr(st, "spec", st.spec.replace(score_order="sparsemixer"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp: sparsemixer routing"):
        moecomp.record_routing(model).__enter__()
    routes = torch.zeros(2, 2, 5, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp: sparsemixer"), moecomp.replay_routing(routes, model):
        pass
    monkeypatch.undo()
    moecomp.unoptimize(model)  # unoptimized: replay works on transformers' forward again
    with torch.no_grad(), moecomp.replay_routing(routes, model):
        assert torch.isfinite(model(input_ids=_ids()).logits).all()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_restored_after_exit(built, family):
    model = built[family]
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    before, keys = _state(model), list(model.state_dict())
    _, rec = _record(model, ids)
    other = (rec.routes + 1) % 4
    with torch.no_grad(), moecomp.replay_routing(other):
        assert rel_err(model(input_ids=ids).logits, ref) > 1e-3
    with pytest.raises(RuntimeError, match="boom"), moecomp.replay_routing(other, model):
        raise RuntimeError("boom")
    with pytest.warns(UserWarning, match=r"2 of 2 MoE block\(s\) \(model\.layers\.0\.mlp, model\.layers\.1\.mlp\) "
                      "was never called"), moecomp.replay_routing(other, model):
        pass  # (the model not called: nothing replayed, and the user hears it)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(after, ref)
    assert _state(model) == before and list(model.state_dict()) == keys


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_record_joins_forwards_along_tokens(built):
    """Forwards in one recording (a prompt, then a step) join along the tokens, as in transformers' generate."""
    model = built["qwen3_moe"]
    ids = _ids(S=6)
    with torch.no_grad(), moecomp.record_routing(model) as whole:
        model(input_ids=ids)
    with torch.no_grad(), moecomp.record_routing(model) as parts:
        out = model(input_ids=ids[:, :4], use_cache=True)
        model(input_ids=ids[:, 4:], past_key_values=out.past_key_values, use_cache=True)
    assert [c.shape[2] for c in parts.calls] == [4, 2]
    assert torch.equal(parts.routes, whole.routes)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_generate_rollout_replayed_over_the_whole_sequence(built):
    """RL: routes recorded during transformers' generate (the prompt, then one step per token), the last token (never
    fed) padded with -1, replayed in one forward over the whole sequence: that forward's logits are the plain
    forward's, and they change when the routes do."""
    model = built["mixtral"]
    prompt = _ids(S=4)
    with torch.no_grad(), moecomp.record_routing(model) as rec:
        seq = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0, use_cache=True)
    assert seq.shape == (2, 7) and [c.shape[2] for c in rec.calls] == [4, 1, 1]
    routes = torch.cat([rec.routes, torch.full_like(rec.routes[:, :, :1], -1)], 2)
    with torch.no_grad():
        ref = model(input_ids=seq).logits
        with moecomp.replay_routing(routes):
            out = model(input_ids=seq).logits
        with moecomp.replay_routing((routes + 1).clamp(max=7)):
            other = model(input_ids=seq).logits
    assert rel_err(out, ref) <= REPLAY_TOL
    assert rel_err(other, ref) > 1e-3


class ListBlock(nn.Module):
    """transformers-4 style: a ModuleList of per-expert MLPs, returns (out, router logits)."""

    def __init__(self, H=32, I=48, E=6, k=2):
        super().__init__()
        self.top_k = k
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList([LinearExpert(H, I) for _ in range(E)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        router_logits = self.gate(x)
        w = torch.softmax(router_logits, dim=1, dtype=torch.float)
        w, sel = torch.topk(w, self.top_k, dim=-1)
        w = (w / w.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(sel == e)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out.view(b, s, h), router_logits


class ListNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ListBlock(), ListBlock()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def test_modulelist_experts_gradients_reach_each_expert():
    """Experts as a ModuleList (the replay stacks them at each call, with autograd), a tuple result with the router
    logits: the replay equals the original forward and its gradients, per expert Linear."""
    torch.manual_seed(0)
    a = ListNet()
    b = copy.deepcopy(a)
    x = torch.randn(2, 3, 32)
    with moecomp.record_routing(a) as rec:
        ref = a(x)
    ref.square().sum().backward()
    with moecomp.replay_routing(rec.routes, b) as ctx:
        out = b(x)
        assert isinstance(b.layers[0](x), tuple)
    out.square().sum().backward()
    assert len(ctx.plans) == 2 and ctx.plans[0].derived  # the stacked experts are a derived tensor
    assert rel_err(out.detach(), ref.detach()) <= REPLAY_TOL
    scale = max(float(p.grad.abs().max()) for p in a.parameters() if p.grad is not None)
    routed = 0
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        # an expert no token chose: no gradient in the original, zeros through the replay's stacked weights
        ga = pa.grad if pa.grad is not None else torch.zeros_like(pa)
        assert pb.grad is not None, name
        assert float((pb.grad - ga).abs().max()) <= GRAD_TOL * scale, name
        routed += pa.grad is not None and ".experts." in name
    assert routed >= 2 * 3 * 2  # (at least two experts of each block got gradients)


def test_replay_forward_shares_no_code_with_oracle_or_op():
    """The replay's forward is its own code: ``api/replay_forward.py`` imports only ``moecomp.core`` (which imports
    neither the oracle nor the ops), read from the source, imports inside functions included."""
    import ast
    import os

    import moecomp.api.replay_forward as mod

    tree = ast.parse(open(mod.__file__, encoding="utf-8").read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            found.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moecomp"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("moecomp")]
    assert found and all(f.startswith("..core.") or f.startswith("moecomp.core.") for f in found), found
    core = os.path.join(os.path.dirname(os.path.dirname(mod.__file__)), "core")
    for f in os.listdir(core):
        if f.endswith(".py"):
            text = open(os.path.join(core, f), encoding="utf-8").read()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom):
                    name = "." * node.level + (node.module or "")
                    assert not any(k in name.split(".") for k in ("oracle", "ops", "kernels")), (f, name)


class SkipNet(nn.Module):
    """Three MoE blocks, the last never called (as a modality's experts that no token reaches)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([ListBlock(), ListBlock(), ListBlock()])

    def forward(self, x):
        for layer in self.layers[:2]:
            x = x + layer(x)[0]
        return x


def test_block_never_called_recorded_as_padding():
    torch.manual_seed(0)
    net = SkipNet()
    x = torch.randn(2, 3, 32)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"1 of 3 MoE block\(s\) \(layers\.2\) was never called"):
        with moecomp.record_routing(net) as rec:
            ref = net(x)
    routes = rec.routes
    assert routes.shape == (3, 2, 3, 2) and bool((routes[2] == -1).all()) and bool((routes[:2] >= 0).all())
    with torch.no_grad(), pytest.warns(UserWarning, match=r"\(layers\.2\) was never called"):
        with moecomp.replay_routing(routes, net):
            out = net(x)
    assert rel_err(out, ref) <= REPLAY_TOL
