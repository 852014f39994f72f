"""Find MoE blocks in a module tree and name their parts, from attributes alone (works on the meta device).

A *block* is the module whose forward runs router + routed experts (+ shared experts) and returns the combined
output, e.g. ``MixtralSparseMoeBlock`` or ``DeepseekV3MoE``. It is recognised by what it owns:

* an *experts* child: either a module holding 3-D expert weights (``gate_up_proj`` / ``up_proj`` / ``down_proj``
  with the experts on dim 0, transformers 5 style; the first weight may hold more experts than ``down_proj``, as
  LongCat-Flash's does for its zero experts: E is then the first weight's, the router's width) or an
  ``nn.ModuleList`` of identical per-expert MLPs (``w1/w3/w2`` or ``gate_proj/up_proj/down_proj``, the older
  layout);
* a *router*: a 2-D weight ``[E, H]`` in the block (outside experts and shared experts), at most two levels deep
  (``gate.weight``, ``router.weight``, ``gate.wg.weight``, ``router.gate.weight``...); where there is none, one of
  ``[E + Z, H]``, 0 < Z < E, whose extra outputs no expert weight holds (zero / identity experts, handled by the
  block's forward: LongCat-Flash from transformers 5.25; ``BlockParts.extra_rows``, read and proven by the FX pass);
* optionally shared experts (a dense MLP child, or S MLPs stacked in one module's 3-D [S, I, H] / [S, H, I]
  Parameters) and their sigmoid gate (a ``Linear(H, 1)``); a router of ``[E + G, H]`` when there are G shared
  experts (its last G rows their gammas, ``MoESpec.shared_gamma``: ``BlockParts.gamma_rows``);
* where the 3-D expert weights work on a width L other than the router's H: latent projections, one linear child
  of weight [L, H] (into the experts) and one of [H, L] (out of them), found by their shapes (NemotronH's
  ``moe_latent_size``: ``MoESpec.latent_size``).

A module none of those names describe, or that they describe wrongly, is still a candidate when its shapes say it
routes (``recognise/discover.py``: a router [E, H] next to experts for it, stacked, flat in 2-D matrices, or one module per
expert in any container, under any names, in a child or the block's own tensors): its parts are then
``kind="structural"`` (router and experts holder only), which only the FX pass can read; the attribute reader refuses
them with a reason.

Nothing here runs the model: :mod:`moecomp.recognise.fallback` turns the parts into a ``MoESpec`` and checks it by running.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.derived import get_path
from ..core.parts import BlockParts, MLPParts
from . import discover
from ..formats.packed import PackedExperts, unpacked_shape

# (gate, up, down) names of a per-expert / shared MLP, gated first.
MLP_NAMES = (
    ("gate_proj", "up_proj", "down_proj"),
    ("w1", "w3", "w2"),
)
UNGATED_MLP_NAMES = (("up_proj", "down_proj"), ("fc1", "fc2"), ("c_fc", "c_proj"), ("w1", "w2"))
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp", "shared")
SHARED_GATE_NAMES = ("shared_expert_gate", "shared_gate", "shared_experts_gate")
CORRECTION_NAMES = ("e_score_correction_bias", "expert_bias", "correction_bias", "router_bias_correction")


class NotABlock(Exception):
    """The module is not an MoE block (not an error)."""


def _owned_tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(m.named_parameters(recurse=False))
    out.update({n: b for n, b in m.named_buffers(recurse=False) if b is not None})
    return {n: t for n, t in out.items() if t is not None}


def _linear_w(m: nn.Module, name: str) -> nn.Module | None:
    c = getattr(m, name, None) if name in getattr(m, "_modules", {}) else None
    if isinstance(c, nn.Linear) or (isinstance(c, nn.Module) and isinstance(getattr(c, "weight", None), torch.Tensor)
                                    and c.weight.dim() == 2 and not isinstance(c, nn.Embedding)):
        return c
    return None


def mlp_parts(m: nn.Module, path: str, hidden: int | None) -> MLPParts | None:
    """Recognise a dense MLP child (gated gate/up/down, concatenated gate_up + down, or up/down)."""
    if not isinstance(m, nn.Module) or isinstance(m, (nn.ModuleList, nn.ModuleDict)):
        return None
    pre = f"{path}." if path else ""

    def bias_path(name, lin):
        return f"{pre}{name}.bias" if getattr(lin, "bias", None) is not None else None

    for g, u, d in MLP_NAMES:
        G, U, D = _linear_w(m, g), _linear_w(m, u), _linear_w(m, d)
        if G is not None and U is not None and D is not None:
            I, H = G.weight.shape
            if U.weight.shape != (I, H) or D.weight.shape != (H, I) or (hidden is not None and H != hidden):
                return None
            return MLPParts(path, True, False, f"{pre}{g}.weight", f"{pre}{u}.weight", f"{pre}{d}.weight",
                            bias_path(g, G), bias_path(u, U), bias_path(d, D), I)
    for gu, d in (("gate_up_proj", "down_proj"), ("w13", "w2")):
        GU, D = _linear_w(m, gu), _linear_w(m, d)
        if GU is not None and D is not None:
            N, H = GU.weight.shape
            if N % 2 or D.weight.shape != (H, N // 2) or (hidden is not None and H != hidden):
                return None
            return MLPParts(path, True, True, f"{pre}{gu}.weight", None, f"{pre}{d}.weight",
                            bias_path(gu, GU), None, bias_path(d, D), N // 2)
    for u, d in UNGATED_MLP_NAMES:
        U, D = _linear_w(m, u), _linear_w(m, d)
        if U is not None and D is not None and len(_params_of(m)) == (2 + sum(x.bias is not None for x in (U, D)
                                                                            if isinstance(x, nn.Linear))):
            I, H = U.weight.shape
            if D.weight.shape != (H, I) or (hidden is not None and H != hidden):
                return None
            return MLPParts(path, False, False, None, f"{pre}{u}.weight", f"{pre}{d}.weight",
                            None, bias_path(u, U), bias_path(d, D), I)
    return None


def _params_of(m: nn.Module) -> list[str]:
    return [n for n, _ in m.named_parameters()]


def _fused_experts(m: nn.Module):
    """(w13 name, w2 name, b13, b2, gated, split) for a module holding 3-D expert weights, else None."""
    t = _owned_tensors(m)
    three = {n: x for n, x in t.items() if x.dim() == 3}
    if not three:
        return None
    gated = bool(getattr(m, "has_gate", True))
    down = next((n for n in ("down_proj", "w2", "output_linear", "fc2", "down") if n in three), None)
    if down is None:
        return None
    split = None
    if "gate_up_proj" in three and gated:
        up = "gate_up_proj"
    elif "w13" in three:
        up = "w13"
    elif "input_linear" in three:
        up = "input_linear"
    elif "gate_proj" in three and "up_proj" in three:
        up, split = "gate_proj", ("gate_proj", "up_proj")
    elif "w1" in three and "w3" in three:
        up, split = "w1", ("w1", "w3")
    elif "up_proj" in three:
        up, gated = "up_proj", False
    elif "fc1" in three:
        up, gated = "fc1", False
    else:
        return None
    if three[up].shape[0] < three[down].shape[0]:  # more first weights than down ones: LongCat-Flash's zero experts
        return None
    b13 = next((b for b in (f"{up}_bias", "gate_up_bias", "b13") if b in t and t[b].dim() == 2), None)
    b2 = next((b for b in (f"{down}_bias", "down_bias", "b2") if b in t and t[b].dim() == 2), None)
    if split is not None:
        b13 = None
    return up, down, b13, b2, gated, split


def experts_child(block: nn.Module) -> str | None:
    """Name of the block's child holding 3-D stacked expert weights, or None."""
    for name, child in block.named_children():
        if not isinstance(child, nn.ModuleList) and _fused_experts(child) is not None:
            return name
    return None


def _expert_list_parts(m: nn.Module, path: str):
    if not isinstance(m, nn.ModuleList) or len(m) < 2:
        return None
    if len({type(e) for e in m}) != 1:
        return None
    parts = [mlp_parts(e, f"{path}.{i}", None) for i, e in enumerate(m)]
    if any(p is None for p in parts):
        return None
    shapes = {(p.gated, p.concat, p.intermediate_size, tuple(get_path(m[i], p.down.split(".", 2)[2]).shape))
              for i, p in enumerate(parts)}
    if len(shapes) != 1:
        return None
    return parts


def _experts_of(block: nn.Module):
    """(name, module, fused parts | None, per-expert MLP parts | None) of the block's experts child."""
    for name, child in block.named_children():
        f = _fused_experts(child) if not isinstance(child, nn.ModuleList) else None
        if f is not None:
            return name, child, f, None
        lst = _expert_list_parts(child, name)
        if lst is not None:
            return name, child, None, lst
    raise NotABlock("no experts child")


def _fill_fused(parts: BlockParts, experts: nn.Module, fused, block: nn.Module) -> None:
    """Weights, layout and sizes of 3-D experts (``fused``: ``_fused_experts``'s answer), checked against H, or
    against the width L of latent projections around them (``_fill_latent``)."""
    up, down, b13, b2, gated, split = fused
    W13, W2 = getattr(experts, up), getattr(experts, down)
    transposed = getattr(experts, "is_transposed", None)
    if split is not None:
        g, u = getattr(experts, split[0]), getattr(experts, split[1])
        if g.shape != u.shape:
            raise NotABlock("separate gate/up expert weights of different shapes")
    a, b = unpacked_shape(experts, W13)[1:]  # 4-bit experts: two codes a byte along the input dim
    c, d = unpacked_shape(experts, W2)[1:]
    n_mult = 1 if (split is not None or not gated) else 2
    # out_in: w13 [E, N, W], w2 [E, W, I];  in_out: w13 [E, W, N], w2 [E, I, W]  (W: the experts' width)
    fits = {False: (b, c) if b == c and a == n_mult * d else None, True: (a, d) if a == d and b == n_mult * c else None}
    H = parts.hidden_size
    if transposed is None:
        transposed = fits[False] is None or fits[False][0] != H and fits[True] is not None and fits[True][0] == H
    width = fits[transposed][0] if fits[transposed] is not None else None
    if width != H and not (width is not None and _fill_latent(parts, block, width)):
        raise NotABlock(f"expert weights {tuple(W13.shape)} / {tuple(W2.shape)}{_packed_note(experts)} do not work "
                        f"on the router's width H={H}, and no linear children [L, H] / [H, L] project to their width")
    I = c if transposed else d
    pre = f"{parts.experts}."
    parts.w13, parts.w2 = pre + up, pre + down
    parts.b13 = pre + b13 if b13 else None
    parts.b2 = pre + b2 if b2 else None
    parts.gated = gated
    parts.w_layout = "in_out" if transposed else "out_in"
    parts.intermediate_size = I
    if split is not None:
        parts.split_gate_up = (pre + split[0], pre + split[1])


def _packed_note(experts: nn.Module) -> str:
    return f" (packed 4-bit: {experts.quant.weight})" if isinstance(experts, PackedExperts) else ""


def _fill_latent(parts: BlockParts, block: nn.Module, L: int) -> bool:
    """Latent projections for experts of width ``L``: exactly one linear child of the block with a weight [L, H] (into
    the experts) and one with [H, L] (out of them), biases on both or neither. Fills ``parts`` and returns True when
    found; False when there are none; NotABlock when they are ambiguous."""
    H = parts.hidden_size
    skip = {parts.experts, parts.router_module.split(".")[0], *SHARED_NAMES, *SHARED_GATE_NAMES}
    found: dict = {"in": [], "out": []}
    for name in block._modules:
        lin = _linear_w(block, name) if name not in skip else None
        if lin is None:
            continue
        shape = tuple(lin.weight.shape)
        b = getattr(lin, "bias", None)
        b = f"{name}.bias" if isinstance(b, torch.Tensor) else None
        if shape == (L, H):
            found["in"].append((f"{name}.weight", b))
        elif shape == (H, L):
            found["out"].append((f"{name}.weight", b))
    if not found["in"] and not found["out"]:
        return False
    if len(found["in"]) != 1 or len(found["out"]) != 1:
        raise NotABlock(f"experts of width {L} under a router of width {H}, and {len(found['in'])} [L, H] / "
                        f"{len(found['out'])} [H, L] linear children: not one projection each way")
    (w_in, b_in), (w_out, b_out) = found["in"][0], found["out"][0]
    if (b_in is None) != (b_out is None):
        raise NotABlock("latent projections with a bias on only one of them")
    parts.latent_size, parts.latent_in, parts.latent_in_bias = L, w_in, b_in
    parts.latent_out, parts.latent_out_bias = w_out, b_out
    return True


def stacked_mlp_parts(m: nn.Module, path: str, hidden: int | None) -> MLPParts | None:
    """S dense MLPs stacked in one module: 3-D gate / up [S, I, H] and down [S, H, I] Parameters (Inkling's shared
    experts), by the MLP names; None otherwise."""
    if not isinstance(m, nn.Module) or isinstance(m, (nn.ModuleList, nn.ModuleDict)):
        return None
    t = _owned_tensors(m)
    pre = f"{path}." if path else ""
    for g, u, d in MLP_NAMES:
        G, U, D = t.get(g), t.get(u), t.get(d)
        if G is None or U is None or D is None or G.dim() != 3:
            continue
        S, I, H = G.shape
        if U.shape != (S, I, H) or tuple(D.shape) != (S, H, I) or (hidden is not None and H != hidden):
            return None
        return MLPParts(path, True, False, f"{pre}{g}", f"{pre}{u}", f"{pre}{d}", intermediate_size=I, stacked=S)
    return None


def _shared_count(block: nn.Module, experts_name: str) -> int:
    """How many shared experts a shared-expert child holds (S stacked, or 1), 0 without one."""
    for name in SHARED_NAMES:
        child = block._modules.get(name)
        if child is None or name == experts_name:
            continue
        sp = stacked_mlp_parts(child, name, None) or mlp_parts(child, name, None)
        if sp is not None:
            return sp.stacked or 1
    return 0
def _one_vector(m: nn.Module, width: int) -> bool:
    """``m`` owns exactly one tensor (parameters and buffers, recursively), 1-D of ``width``: a norm's weight."""
    ts = list(m.parameters()) + list(m.buffers())
    return len(ts) == 1 and tuple(ts[0].shape) == (width,) and ts[0].is_floating_point()


def _fill_norms(block: nn.Module, parts: BlockParts, experts: nn.Module, taken: set) -> None:
    """Norm modules around the experts, by shape: with latent projections, the one child of the block left whose only
    tensor is [L] (the latent input's norm); a child of the experts module whose only tensor is the experts' width
    (each expert's output norm). What they compute is measured (``recognise/norm_fit.py``)."""
    width = parts.latent_size or parts.hidden_size
    if parts.latent_size:
        cands = [n for n, c in block.named_children() if n not in taken and c is not None and _one_vector(c, width)]
        if len(cands) > 1:
            raise NotABlock(f"{len(cands)} children of the block hold one [{width}] vector: not one latent norm")
        if cands:
            parts.latent_norm = cands[0]
            taken.add(cands[0])
    cands = [n for n, c in experts.named_children() if c is not None and _one_vector(c, width)]
    if len(cands) > 1:
        raise NotABlock(f"{len(cands)} children of the experts hold one [{width}] vector: not one output norm")
    if cands:
        parts.expert_norm = f"{parts.experts}.{cands[0]}"


def _fill_shared(block: nn.Module, parts: BlockParts, taken: set) -> None:
    """The shared expert MLP and its sigmoid gate, found by name among the block's children (added to ``taken``)."""
    H = parts.hidden_size
    for name in SHARED_NAMES:
        child = block._modules.get(name)
        sp = (stacked_mlp_parts(child, name, H) or mlp_parts(child, name, H)) if child is not None else None
        if sp is not None:
            parts.shared = sp
            taken.add(name)
            break
    for name in SHARED_GATE_NAMES:
        child = block._modules.get(name)
        if isinstance(child, nn.Linear) and tuple(child.weight.shape) == (1, H) and child.bias is None:
            parts.shared_gate = f"{name}.weight"
            taken.add(name)
            break


def find_parts(block: nn.Module) -> BlockParts:
    """Name the parts of a candidate block, or raise NotABlock."""
    experts_name, experts, fused, mlps = _experts_of(block)
    E = getattr(experts, fused[0]).shape[0] if fused is not None else len(mlps)
    router = _find_router(block, experts_name, E)  # the router pins H
    gamma_rows = 0
    if router is None:  # a router with one more row per shared expert (their gammas): [E + G, H]
        gamma_rows = _shared_count(block, experts_name)
        router = _find_router(block, experts_name, E + gamma_rows) if gamma_rows else None
    extra_rows = 0
    if router is None:  # a router wider than the experts, E < E' < 2E: zero / identity experts (read by the FX pass)
        router = _find_router(block, experts_name, E, wider=True)
        extra_rows = get_path(block, router[0]).shape[0] - E if router is not None else 0
    if router is None:
        raise NotABlock(f"experts {experts_name!r} ({E} experts) but no router weight [{E}, H] next to them (the "
                        f"router is not one linear map of the hidden states)")
    router_w_path, router_mod_path, H = router
    parts = BlockParts(experts=experts_name, kind="fused" if fused else "modulelist", num_experts=E,
                       hidden_size=H, intermediate_size=0, router_weight=router_w_path,
                       router_module=router_mod_path, gamma_rows=gamma_rows, extra_rows=extra_rows)
    R = E + extra_rows  # the router's outputs
    rb = getattr(get_path(block, router_mod_path), "bias", None)
    if isinstance(rb, torch.Tensor) and tuple(rb.shape) == (R,):
        parts.router_bias = f"{router_mod_path}.bias" if router_mod_path else "bias"
    if fused is not None:
        _fill_fused(parts, experts, fused, block)
    else:
        parts.expert_mlps = mlps
        parts.gated = mlps[0].gated
        parts.intermediate_size = mlps[0].intermediate_size
        parts.w_layout = "out_in"
    taken = {experts_name, router_mod_path.split(".")[0] if router_mod_path else None}
    taken |= {w.split(".")[0] for w in (parts.latent_in, parts.latent_out) if w is not None}
    _fill_shared(block, parts, taken)
    if fused is not None:
        _fill_norms(block, parts, experts, taken)
    # correction bias: a float [E] (or [1, E]) tensor of the block or router, not the router's own bias
    parts.correction_bias = _find_correction_bias(block, router_mod_path, R, parts.router_bias)
    parts.extra_modules += [name for name, child in block.named_children()
                            if name not in taken and child is not None and any(True for _ in child.parameters())]
    return parts


def _find_router(block: nn.Module, experts_name: str, E: int, wider: bool = False):
    """(weight path, owning module path, H) of the router: a 2-D [E, H] weight outside the experts (``wider``: [E', H]
    with E < E' < 2E instead)."""
    best = None
    for mod_name, mod in block.named_modules():
        depth = mod_name.count(".") + 1 if mod_name else 0
        if depth > 2 or mod_name.split(".")[0] == experts_name:
            continue
        if any(mod_name.split(".")[0] == s for s in SHARED_NAMES + SHARED_GATE_NAMES):
            continue
        for pname, p in mod.named_parameters(recurse=False):
            if p.dim() != 2 or (not E < p.shape[0] < 2 * E if wider else p.shape[0] != E):
                continue
            score = 0
            lname = (mod_name + "." + pname).lower()
            if any(k in lname for k in ("gate", "router", "wg", "route")):
                score += 2
            if pname == "weight":
                score += 1
            score -= depth
            if best is None or score > best[0]:
                best = (score, f"{mod_name}.{pname}" if mod_name else pname, mod_name, int(p.shape[1]))
    if best is None:
        return None
    # the router module is the block's child that holds the weight (a TopKRouter, or a Linear)
    return best[1], best[2].split(".")[0] if best[2] else "", best[3]


def _find_correction_bias(block: nn.Module, router_mod: str, E: int, router_bias: str | None) -> str | None:
    """A float tensor of E values on the block, the router or the router's children (not the router's bias)."""
    mods = [("", block)]
    if router_mod:
        rm = get_path(block, router_mod)
        mods += [(f"{router_mod}.{n}" if n else router_mod, m) for n, m in rm.named_modules()]
    cands = []
    for mod_name, mod in mods:
        for n, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if t is None or not t.is_floating_point() or t.numel() != E or t.dim() > 2:
                continue
            full = f"{mod_name}.{n}" if mod_name else n
            if full == router_bias:
                continue
            if any(k in n for k in CORRECTION_NAMES) or "correction" in n or "bias" in n and "expert" in n:
                cands.append(full)
    return cands[0] if cands else None


def structural_parts(block: nn.Module) -> BlockParts | None:
    """Router and experts of a block that ``find_parts``' names do not describe but whose shapes say it routes
    (``discover.block_router``), as ``kind="structural"`` parts; None when its shapes do not."""
    r = discover.block_router(block, None)
    if r is None:
        return None
    rname, w_path, E = r
    H = int(get_path(block, w_path).shape[1])
    experts = discover.experts_holder(block, rname, E, H)  # "": spread over several children, or the block's own
    if experts is None:
        return None
    parts = BlockParts(experts=experts, kind="structural", num_experts=E, hidden_size=H, intermediate_size=0,
                       router_weight=w_path, router_module=rname)
    rb = getattr(get_path(block, rname), "bias", None) if rname else None
    if isinstance(rb, torch.Tensor) and tuple(rb.shape) == (E,):
        parts.router_bias = f"{rname}.bias"
    parts.correction_bias = _find_correction_bias(block, rname, E, parts.router_bias)
    parts.extra_modules = [n for n, c in block.named_children()
                           if n not in (experts, rname) and c is not None and any(True for _ in c.parameters())
                           and not (experts == "" and discover.holds_expert_weights(c))]
    return parts


def iter_blocks(model: nn.Module):
    """Yield (name, module, BlockParts | None, reason) for every candidate MoE block, innermost wins.

    A module is a candidate if it has an experts child (3-D expert weights or a ModuleList of expert MLPs), or if
    its shapes say it routes (``structural_parts``; also where the part names describe it wrongly: a finder by names
    never keeps the FX pass from a block its shapes show). Those without a router are still yielded (parts None) so that
    the report can say why they were skipped.
    """
    claimed: list[str] = []
    found = []
    for name, mod in reversed(list(model.named_modules())):  # children before parents
        if any(name == "" or c.startswith(name + ".") for c in claimed):
            continue
        try:
            parts = find_parts(mod)
        except NotABlock as e:
            # the part names do not describe it: still a candidate for the FX pass when its shapes say it routes
            parts = structural_parts(mod) if name else None
            if parts is None and str(e) != "no experts child":  # an experts module, but not a block we can describe
                found.append((name, mod, None, str(e)))
                claimed.append(name)
                continue
            if parts is None:
                continue
        found.append((name, mod, parts, ""))
        claimed.append(name)
    found.reverse()
    return found
