"""Weights after ``moecomp.optimize``: every kind of change is followed, for every experts layout; shared storage;
gradients; meta tensors.

Each model is compared with its unoptimized reference (a deep copy taken before ``optimize``) that gets the same
change, on fresh random inputs. Tolerance: fp32 / fp64 within 1e-4 relative (max |optimized - reference| /
max |reference|); fp16 within 1e-2 relative per token, except at most one token per input (an fp16 near-tie in the
routing may pick the other expert; ``optimize``'s own check excuses such tokens the same way); gradients within
1e-6 relative (the original forward runs on both sides).
"""

from __future__ import annotations

import copy
import io
import os
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import moecomp  # noqa: E402
from moecomp.bind import bind as B  # noqa: E402
from moecomp.coverage import families as F  # noqa: E402
from moecomp.core.derived import SharedLayout  # noqa: E402
from moecomp.api.optimize import experts_only_modules, rewritten_blocks  # noqa: E402
from moecomp.testing import LinearExpert, SplitBlock  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.float64: 1e-4}




def rel_err(a, ref) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max())


# ----------------------------------------------------------------------------------------------- tiny models
class TinyMoEConfig(transformers.PretrainedConfig):
    model_type = "moecomp_tiny_modulelist"

    def __init__(self, hidden_size=32, intermediate_size=48, num_experts=6, num_experts_per_tok=2, num_layers=2,
                 **kw):
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.num_experts_per_tok, self.num_layers = num_experts, num_experts_per_tok, num_layers
        super().__init__(**kw)


class ListBlock(nn.Module):
    """transformers-4 style: a ModuleList of per-expert MLPs (nn.Linear), routing in the block."""

    def __init__(self, cfg):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = True
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList([LinearExpert(cfg.hidden_size, cfg.intermediate_size) for _ in range(cfg.num_experts)])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        w = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        w, sel = torch.topk(w, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        w = w.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(sel == e)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out.view(b, s, h)


class TinyMoEModel(transformers.PreTrainedModel):
    """A transformers model whose experts are a ModuleList of nn.Linear MLPs (no installed family has one)."""

    config_class = TinyMoEConfig
    base_model_prefix = "tiny"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = nn.ModuleList([ListBlock(cfg) for _ in range(cfg.num_layers)])
        self.post_init()

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.2)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x




def _ids(seed):
    return {"input_ids": torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(seed))}


def _x(seed):
    return {"x": torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(seed))}


def _hf_out(model, inp):
    with torch.no_grad():
        return model(**inp, use_cache=False).logits


def _plain_out(model, inp):
    with torch.no_grad():
        return model(inp["x"].to(next(model.parameters()).dtype))


def _modulelist():
    torch.manual_seed(0)
    return TinyMoEModel(TinyMoEConfig()).eval()


def _split():
    torch.manual_seed(0)
    return nn.Sequential(SplitBlock(), SplitBlock()).eval()


def _tiny(family):
    def make():
        return F.build_tiny(family, seed=0)[0]
    return make


def experts_only_tiny():
    """A tiny model whose blocks are experts only (zaya: no router weight the recognisers read), its
    experts' weights scaled up (gate_up x 10, down x 10 / 3) so that their activation works off its linear part and
    the experts matter in the logits: a change of either shows (PhiMoE served here until its routing was in the
    spec)."""
    model = F.build_tiny("zaya", seed=0)[0]
    with torch.no_grad():
        for m in model.modules():
            if F.is_experts_class(type(m)):
                m.gate_up_proj.mul_(10.0)
                m.down_proj.mul_(10.0 / 3)
    return model


# name -> (make, inputs, output, expert weights to change as (owner path, tensor name), expected status)
LAYOUTS = {
    "modulelist": (_modulelist, _x, _plain_out,
                   [(f"layers.{i}.experts.{e}.{w}", "weight") for i in (0, 1) for e in (0, 3, 5) for w in
                    ("w1", "w3", "w2")] + [("layers.0.gate", "weight")], "rewritten"),
    # 3-D fused gate_up_proj; a shared expert with a sigmoid gate (the router buffer shares router + gate rows)
    "fused": (_tiny("qwen2_moe"), _ids, _hf_out,
              [(f"model.layers.{i}.mlp.{p}", n) for i in (0, 1) for p, n in (
                  ("experts", "gate_up_proj"), ("experts", "down_proj"), ("gate", "weight"),
                  ("shared_expert_gate", "weight"))], "rewritten"),
    "split": (_split, _x, _plain_out,
              [(f"{i}.experts", n) for i in (0, 1) for n in ("gate_proj", "up_proj", "down_proj")] +
              [("0.gate", "weight")], "rewritten"),
    # routing stays transformers'; the experts module runs moe_experts
    "experts_only": (experts_only_tiny, _ids, _hf_out,
                     [(f"model.layers.{i}.mlp.experts", n) for i in (0, 1) for n in ("gate_up_proj", "down_proj")],
                     "experts only"),
}


def _tensor(model, owner, name):
    m = model.get_submodule(owner)
    return m._parameters[name] if name in m._parameters else m._buffers[name]


def _calls(model) -> int:
    return sum(m._moecomp.calls for m in rewritten_blocks(model).values()) + sum(
        m._moecomp_experts.calls for m in experts_only_modules(model).values())


def _new_values(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t.shape, generator=g, dtype=torch.float64) * float(t.detach().double().std())).to(t.dtype)


# ----------------------------------------------------------------------------------------------- changes
def _inplace(model, weights):
    with torch.no_grad():
        for i, (o, n) in enumerate(weights):
            _tensor(model, o, n).mul_(1.5).add_(_new_values(_tensor(model, o, n), i), alpha=0.2)


def _data_copy(model, weights):
    for i, (o, n) in enumerate(weights):
        t = _tensor(model, o, n)
        t.data.copy_(_new_values(t, i))


def _data_ema(model, weights):  # what EMA loops do: p.data.mul_(d).add_(q.data, alpha=1 - d)
    for i, (o, n) in enumerate(weights):
        t = _tensor(model, o, n)
        t.data.mul_(0.5).add_(_new_values(t, i + 100), alpha=0.5)


def _data_mul(model, weights):
    for o, n in weights:
        _tensor(model, o, n).data.mul_(3)


def _new_parameter(model, weights):
    for i, (o, n) in enumerate(weights):
        t = _tensor(model, o, n)
        setattr(model.get_submodule(o), n, nn.Parameter(_new_values(t, i + 200)))


def _perturbed_state(model, weights) -> dict:
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, (o, n) in enumerate(weights):
        sd[f"{o}.{n}"] = _new_values(sd[f"{o}.{n}"], i + 300)
    return sd


def _load_state_dict(model, weights):
    model.load_state_dict(_perturbed_state(model, weights))


def _load_state_dict_assign(model, weights):
    model.load_state_dict(_perturbed_state(model, weights), assign=True)


def _to_empty_load(model, weights):
    sd = _perturbed_state(model, weights)
    # non-persistent buffers are not in the state dict (rotary inv_freq: put back by hand; moecomp's: left empty)
    keep = {n: b.clone() for n, b in model.named_buffers() if n not in sd and "_moecomp" not in n}
    model.to_empty(device="cpu")
    model.load_state_dict(sd)
    with torch.no_grad():
        for n, b in keep.items():
            model.get_buffer(n).copy_(b)


CHANGES = {
    "inplace_no_grad": _inplace,
    "data_copy": _data_copy,
    "data_ema": _data_ema,
    "data_mul": _data_mul,
    "new_parameter": _new_parameter,
    "load_state_dict": _load_state_dict,
    "load_state_dict_assign": _load_state_dict_assign,
    "to_empty_load_state_dict": _to_empty_load,
}

# Weights moecomp must copy (separate 3-D gate / up: the sources would be strided views) do not see ``.data``
# writes (no version bump); documented (moecomp.bind.bind): ``moecomp.optimize(model)`` again rebuilds the copies.
REOPTIMIZE = {("split", c) for c in ("data_copy", "data_ema", "data_mul")}


def _pair(layout):
    make, inputs, out, weights, status = LAYOUTS[layout]
    model = make()
    ref = copy.deepcopy(model)
    _, rep = moecomp.optimize(model, report=True)
    assert rep.blocks and all(b.status == status for b in rep.blocks), str(rep)
    return model, ref, inputs, out, weights


def _check(model, ref, inputs, out, seeds, dtype=torch.float32):
    c0 = _calls(model)
    for s in seeds:
        y, r = out(model, inputs(s)), out(ref, inputs(s))
        assert y.dtype == r.dtype == dtype
        assert torch.isfinite(y).all()
        if dtype == torch.float16:
            per_token = (y.double() - r.double()).abs().amax(-1) / r.double().abs().max()
            assert int((per_token > TOL[dtype]).sum()) <= 1, (s, per_token.max())
        else:
            assert rel_err(y, r) <= TOL[dtype], (s, rel_err(y, r))
    assert _calls(model) - c0 >= len(seeds)  # the op ran (not the original forward)


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_weight_change_is_followed(layout, change):
    model, ref, inputs, out, weights = _pair(layout)
    _check(model, ref, inputs, out, [1])  # first forward: derived tensors built (and shared)
    before = out(ref, inputs(2))
    CHANGES[change](ref, weights)
    CHANGES[change](model, weights)
    assert rel_err(out(ref, inputs(2)), before) > 1e-2  # the change changes the output
    if (layout, change) in REOPTIMIZE:
        moecomp.optimize(model)
    _check(model, ref, inputs, out, [2, 3])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dtype_changes_are_followed(layout):
    """``.half()``, back with ``.float()``, then ``.to(torch.float64)`` (not for the transformers families, whose own
    grouped_mm experts path refuses fp64)."""
    model, ref, inputs, out, weights = _pair(layout)
    _check(model, ref, inputs, out, [1])
    for m in (model, ref):
        m.half()
    _check(model, ref, inputs, out, [2], torch.float16)
    for m in (model, ref):
        m.float()
    _check(model, ref, inputs, out, [3])
    _inplace(ref, weights)  # still followed after the round trip
    _inplace(model, weights)
    _check(model, ref, inputs, out, [4])
    if layout in ("modulelist", "split"):
        for m in (model, ref):
            m.to(torch.float64)
        _check(model, ref, inputs, out, [5], torch.float64)


# ----------------------------------------------------------------------------------------------- shared storage
def _storages(module) -> dict:
    out = {}
    for t in list(module.parameters()) + list(module.buffers()):
        s = t.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def test_modulelist_data_writes_after_first_forward():
    """The issue's case: ``expert.w1.weight.data.copy_(new)`` / ``.data.mul_(3)`` after a first forward."""
    model, ref, inputs, out, _ = _pair("modulelist")
    _check(model, ref, inputs, out, [1])
    for m in (model, ref):
        m.layers[0].experts[2].w1.weight.data.copy_(_new_values(m.layers[0].experts[2].w1.weight, 7))
        m.layers[1].experts[4].w2.weight.data.mul_(3)
    _check(model, ref, inputs, out, [2, 3])
    blk = model.layers[0]
    buf = blk._moecomp_w13
    assert isinstance(blk._moecomp.versions["_moecomp_w13"], SharedLayout)
    assert blk._moecomp_w13 is buf  # no rebuild was needed: the experts' weights are the buffer


def test_modulelist_weights_held_once():
    """After optimize the expert weights are one storage (the stacked buffer), not per-expert tensors plus a copy."""
    model, ref, inputs, out, _ = _pair("modulelist")
    _check(model, ref, inputs, out, [1])
    E, H, I = 6, 32, 48
    for blk, rblk in zip(model.layers, ref.layers):
        expert_bytes = E * 3 * H * I * 4
        router_bytes = E * H * 4
        assert sum(_storages(rblk).values()) == expert_bytes + router_bytes
        assert sum(_storages(blk).values()) == expert_bytes + router_bytes  # nothing held twice
        w13, w2 = blk._moecomp_w13, blk._moecomp_w2
        for e, ex in enumerate(blk.experts):
            assert ex.w1.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
            assert torch.equal(w13[e, :I], ex.w1.weight) and torch.equal(w13[e, I:], ex.w3.weight)
            assert torch.equal(w2[e], ex.w2.weight) and ex.w2.weight.is_contiguous()
        assert isinstance(blk.experts[0].w1.weight, nn.Parameter)
    rep = moecomp.scan(model)
    assert all(b.status == "already" and b.extra_bytes == 0 for b in rep.blocks)


def test_same_parameter_objects_keep_working_with_an_optimizer():
    """Re-pointing keeps the Parameter objects: an optimizer made before optimize() still updates what the op uses."""
    model, ref, inputs, out, _ = _pair("modulelist")
    p_model = list(model.parameters())
    _check(model, ref, inputs, out, [1])
    assert [id(p) for p in model.parameters()] == [id(p) for p in p_model]
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for p in m.parameters():
            p.grad = _new_values(p, 11)
        opt.step()
    _check(model, ref, inputs, out, [2])


def test_unoptimize_leaves_correct_independent_params():
    model, ref, inputs, out, weights = _pair("modulelist")
    _check(model, ref, inputs, out, [1])
    moecomp.unoptimize(model)
    assert not any(n.startswith("_moecomp") for m in model.modules() for n in m._buffers)
    assert not rewritten_blocks(model)
    for (n, p), (rn, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == rn and torch.equal(p, rp) and p.is_contiguous() and isinstance(p, nn.Parameter)
    x = inputs(2)
    assert torch.equal(out(model, x), out(ref, x))
    # a write to one expert changes that expert only (views of one storage, disjoint)
    for m in (model, ref):
        with torch.no_grad():
            m.layers[0].experts[1].w3.weight.mul_(-1)
    for (n, p), (_, rp) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, rp), n
    assert torch.equal(out(model, inputs(3)), out(ref, inputs(3)))
    moecomp.optimize(model)  # and it can be optimized again
    _check(model, ref, inputs, out, [4])


def test_state_dict_torch_save_load_and_deepcopy():
    model, ref, inputs, out, weights = _pair("modulelist")
    _check(model, ref, inputs, out, [1])
    sd, rsd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd) and all(torch.equal(sd[k], rsd[k]) for k in sd)
    # state_dict -> file -> a fresh, unoptimized model
    f = io.BytesIO()
    torch.save(sd, f)
    fresh = _modulelist()
    fresh.load_state_dict(torch.load(io.BytesIO(f.getvalue())))
    assert torch.equal(out(fresh, inputs(2)), out(ref, inputs(2)))
    # ... and into the optimized model (in place: still shared, no rebuild)
    buf = model.layers[0]._moecomp_w13
    model.load_state_dict(_perturbed_state(model, LAYOUTS["modulelist"][3]))
    ref.load_state_dict(_perturbed_state(ref, LAYOUTS["modulelist"][3]))
    _check(model, ref, inputs, out, [3])
    assert model.layers[0]._moecomp_w13 is buf
    # the whole model pickled: loads bound and still shared
    f = io.BytesIO()
    torch.save(model, f)
    loaded = torch.load(io.BytesIO(f.getvalue()), weights_only=False)
    blk = loaded.layers[0]
    assert blk._moecomp.versions["_moecomp_w13"].current(blk._moecomp_w13)
    _check(loaded, ref, inputs, out, [4])
    for m in (loaded, ref):
        m.layers[1].experts[0].w2.weight.data.mul_(2)
    _check(loaded, ref, inputs, out, [5])
    # deepcopy: the copy gets its own storage (re-shared on its first call), independent of the original
    dc = copy.deepcopy(loaded)
    _check(dc, ref, inputs, out, [6])
    assert dc.layers[0]._moecomp_w13.data_ptr() != loaded.layers[0]._moecomp_w13.data_ptr()
    loaded.layers[0].experts[0].w1.weight.data.mul_(5)
    _check(dc, ref, inputs, out, [7])


def test_save_pretrained_round_trip(tmp_path):
    """safetensors refuses overlapping tensors; the experts are disjoint views of one buffer, which transformers'
    save_pretrained clones before writing. The file holds each weight once; the loaded model equals."""
    model, ref, inputs, out, _ = _pair("modulelist")
    _check(model, ref, inputs, out, [1])
    model.save_pretrained(tmp_path)
    assert os.path.exists(tmp_path / "model.safetensors")
    n_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert os.path.getsize(tmp_path / "model.safetensors") < n_bytes + 16384  # each weight once (+ header)
    loaded = TinyMoEModel.from_pretrained(tmp_path).eval()
    sd_loaded, sd_ref = loaded.state_dict(), ref.state_dict()
    assert set(sd_loaded) == set(sd_ref) and all(torch.equal(sd_loaded[k], v) for k, v in sd_ref.items())
    # the same weights, bit for bit; the outputs of two plain models may still differ in the last fp32 bit (CPU GEMM
    # kernels pick their path by operand alignment: 3e-7 seen on torch 2.13), so they are compared within 1e-6
    torch.testing.assert_close(out(loaded, inputs(2)), out(ref, inputs(2)), rtol=1e-6, atol=1e-6)
    blk = model.layers[0]
    assert blk._moecomp.versions["_moecomp_w13"].current(blk._moecomp_w13)  # saving left the sharing alone
    moecomp.optimize(loaded)
    _check(loaded, ref, inputs, out, [3])
    loaded.save_pretrained(tmp_path / "again")  # an optimized, loaded model saves too
    again = TinyMoEModel.from_pretrained(tmp_path / "again").eval()
    sd_again = again.state_dict()
    assert set(sd_again) == set(sd_ref) and all(torch.equal(sd_again[k], v) for k, v in sd_ref.items())
    torch.testing.assert_close(out(again, inputs(4)), out(ref, inputs(4)), rtol=1e-6, atol=1e-6)


def test_expert_module_shared_by_two_blocks():
    """A tensor that is a source of two blocks is shared by the first; the second keeps a copy (re-pointing it for
    both would make them rebuild on every call). Both stay correct and neither rebuilds when nothing changes."""
    model = _modulelist()
    for e in range(6):
        model.layers[1].experts[e] = model.layers[0].experts[e]
    ref = copy.deepcopy(model)
    moecomp.optimize(model)
    inputs, out = _x, _plain_out
    _check(model, ref, inputs, out, [1])
    b0, b1 = model.layers[0], model.layers[1]
    kinds = {type(b._moecomp.versions["_moecomp_w13"]).__name__ for b in (b0, b1)}
    assert kinds == {"SharedLayout", "tuple"}
    bufs = (b0._moecomp_w13, b1._moecomp_w13)
    _check(model, ref, inputs, out, [2])
    assert (b0._moecomp_w13, b1._moecomp_w13) == bufs  # no rebuild
    with torch.no_grad():
        for m in (model, ref):
            m.layers[0].experts[2].w1.weight.mul_(2)
    _check(model, ref, inputs, out, [3])


# ----------------------------------------------------------------------------------------------- gradients
@pytest.fixture
def grad_warning_once(monkeypatch):
    """The gradient warning is once per process: start each test from a fresh state."""
    from moecomp.bind import bind_common

    monkeypatch.setattr(bind_common, "_grad_warned", False)


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["fused", "experts_only"])
def test_backward_in_eval_mode_gives_exact_gradients(layout, grad_warning_once):
    model, ref, inputs, _, _ = _pair(layout)  # eval mode, as after from_pretrained
    ids = inputs(1)["input_ids"]
    with pytest.warns(UserWarning, match="once per process"):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    rloss = ref(input_ids=ids, labels=ids, use_cache=False).loss
    rloss.backward()
    assert rel_err(loss, rloss) <= 1e-6
    g, rg = _grads(model), _grads(ref)
    assert set(g) == set(rg) and len(g) == len(list(ref.parameters()))
    assert all(rel_err(g[n], rg[n]) <= 1e-6 for n in g if rg[n].abs().max() > 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        model(input_ids=ids, use_cache=False)
    # no_grad / inference_mode calls keep the op
    c0 = _calls(model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    assert _calls(model) - c0 == 2 * 2  # two layers, two calls


@pytest.mark.parametrize("layout", ["fused", "experts_only"])
def test_input_attribution_with_frozen_weights(layout, grad_warning_once):
    model, ref, inputs, _, _ = _pair(layout)
    ids = inputs(1)["input_ids"]
    grads = []
    for m in (model, ref):
        m.requires_grad_(False)
        emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(inputs_embeds=emb, use_cache=False).logits.square().sum().backward()
        grads.append(emb.grad)
    assert grads[0] is not None and rel_err(grads[0], grads[1]) <= 1e-6
    c0 = _calls(model)  # frozen weights, grad mode on, inputs not requiring grad: the op runs
    x = model.get_input_embeddings()(ids)
    y = model(inputs_embeds=x, use_cache=False).logits
    assert _calls(model) - c0 == 2 and rel_err(y, ref(inputs_embeds=x, use_cache=False).logits) <= 1e-4


def test_backward_modulelist_experts_shared_weights(grad_warning_once):
    """Gradients reach the re-pointed expert Parameters (views of the stacked buffer) exactly."""
    model, ref, inputs, out, _ = _pair("modulelist")
    _check(model, ref, inputs, out, [1])
    x = inputs(2)["x"]
    with pytest.warns(UserWarning, match="requires grad"):
        model(x).square().sum().backward()
    ref(x).square().sum().backward()
    g, rg = _grads(model), _grads(ref)
    assert set(g) == set(rg) and len(g) == len(list(ref.parameters()))
    assert all(rel_err(g[n], rg[n]) <= 1e-6 for n in g if rg[n].abs().max() > 0)


def test_compile_backend_leaves_blocks_whose_input_needs_grad():
    """The torch.compile backend: with frozen weights and ``inputs_embeds.requires_grad``, the blocks are left as
    they are (the op has no backward); gradients equal eager's."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "passes"))
    import tiny_models as tm

    model = tm.hf_model("qwen3_moe").requires_grad_(False)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    emb = model.get_input_embeddings()(ids).detach()
    e1, e2 = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    model(inputs_embeds=e1).logits.square().sum().backward()
    torch._dynamo.reset()
    moecomp.counters.clear()
    try:
        compiled = torch.compile(model, backend="moecomp", options={"moecomp.inner": "eager"})
        compiled(inputs_embeds=e2).logits.square().sum().backward()
    finally:
        torch._dynamo.reset()
    assert moecomp.counters["rewrite_moe"]["replaced"] == 0
    assert moecomp.counters["backend"]["skipped_autograd"] == tm.LAYERS
    assert rel_err(e2.grad, e1.grad) <= 1e-5


# ----------------------------------------------------------------------------------------------- meta tensors
def test_optimize_on_meta_warns():
    cfg = TinyMoEConfig()
    with torch.device("meta"):
        model = TinyMoEModel(cfg)
    with pytest.warns(UserWarning, match=r"meta tensors.*moecomp\.scan\(model\)"):
        _, rep = moecomp.optimize(model, report=True)
    assert len(rep.blocks) == 2 and not rewritten_blocks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scan is the tool for meta models: it does not warn
        assert len(moecomp.scan(model).blocks) == 2
    # a transformers family (fused experts) on meta, as from_pretrained(device_map="meta") or init_empty_weights
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(F.tiny_config(Qwen3MoeConfig, "qwen3_moe"))
    with pytest.warns(UserWarning, match="2 MoE block"):
        moecomp.optimize(hf)
    assert not rewritten_blocks(hf) and not experts_only_modules(hf)
