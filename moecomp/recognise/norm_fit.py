"""The attribute reader's norms (``MoESpec.latent_norm`` / ``expert_norm``): what a norm module computes, measured.

``recognise/structure.py`` names the modules by shape (one 1-D weight of the experts' width); this module runs each on probe
rows through ``torch.func.functional_call`` with its weight replaced by a random one (the model's is not touched; a
zero weight, as MuseSpark's start, would make rms * (1 + w) and rms * w indistinguishable), in fp32, and fits:

    for each form the spec knows:  pre = v (rms forms) | round(v * (1 + w)) (scaled_rms_1p), post = 1 + w | w | 1
        r   = out / (pre * post)          (per row: rsqrt(mean(pre ** 2) + eps))
        eps = mean over the rows of 1 / r ** 2 - mean(pre ** 2)      (rows of rms 1e-5 .. 1: eps dominates in some)
    the first form whose ``reference.rms_norm`` with that eps reproduces the module on every probe row is taken.
"""

from __future__ import annotations

import torch
from torch import nn

from ..oracle import reference
from ..core.reject import raise_if_oom

_SCALES = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # row rms of the probe rows


def fit_norm(module: nn.Module, forms: tuple, width: int, seed: int = 0) -> tuple[str, float] | None:
    """(form, eps) of the norm ``module`` over rows of ``width``, or None when no form of ``forms`` reproduces it."""
    (name, _), = list(module.named_parameters()) + list(module.named_buffers())
    gen = torch.Generator().manual_seed(seed)
    w = 0.5 * torch.randn(width, generator=gen, dtype=torch.float32)
    v = torch.randn(len(_SCALES) * 4, width, generator=gen, dtype=torch.float32)
    v = v / v.pow(2).mean(-1, keepdim=True).sqrt() * torch.tensor(_SCALES).repeat_interleave(4)[:, None]
    try:
        with torch.no_grad():
            out = torch.func.functional_call(module, {name: w}, (v,)).float()
    except Exception as e:  # noqa: BLE001  (a module that cannot run on such rows is no norm the spec knows)
        raise_if_oom(e)
        return None
    for form in forms:
        pre = v * (1 + w) if form == "scaled_rms_1p" else v
        post = w if form == "rms" else (1 + w) if form == "rms_1p" else torch.ones_like(w)
        denom = pre * post
        ok = denom.abs() > 1e-30
        if not bool(ok.all()):
            continue
        r = (out / denom).mean(-1)  # [rows]
        eps = float(((1 / r.double() ** 2) - pre.double().pow(2).mean(-1))[:4].mean())  # the smallest rows
        eps = 0.0 if abs(eps) < 1e-12 else float(f"{eps:.3g}")
        if eps < 0:
            continue
        want = reference.rms_norm(v, w, form, eps, torch.float32)
        if torch.allclose(out, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            return form, eps
    return None


class NormUnread(Exception):
    """A norm module named by shape whose computation is no form the spec knows (or cannot be measured here)."""


def read_norms(block: nn.Module, parts) -> tuple[dict, dict, list]:
    """(spec fields, op-argument bindings, notes) of the norms ``parts`` names (``BlockParts.latent_norm`` /
    ``expert_norm``); empty without them. NormUnread when one cannot be measured (meta tensors) or fits no form."""
    from ..core.spec_checks import EXPERT_NORMS, LATENT_NORMS
    from ..core.derived import get_path

    fields, bindings, notes = {}, {}, []
    width = parts.latent_size or parts.hidden_size
    for which, path, forms in (("latent", parts.latent_norm, LATENT_NORMS), ("expert", parts.expert_norm,
                                                                             EXPERT_NORMS)):
        if path is None:
            continue
        mod = get_path(block, path)
        (pname, t), = list(mod.named_parameters()) + list(mod.named_buffers())
        if t.device.type == "meta":
            raise NormUnread(f"the {which} norm {path} can only be measured on real tensors (meta device)")
        got = fit_norm(mod, tuple(f for f in forms if f != "none"), width)
        if got is None:
            raise NormUnread(f"the {which} norm {path} ({type(mod).__name__}) computes none of the norms "
                             f"{[f for f in forms if f != 'none']} on probe rows")
        fields.update({f"{which}_norm": got[0], f"{which}_norm_eps": got[1]})
        bindings[f"{which}_norm_w"] = f"{path}.{pname}"
        notes.append(f"{which} norm {path}: {got[0]} eps={got[1]:g} (measured)")
    return fields, bindings, notes
