"""Routed experts stored in a 4-bit format (``QuantSpec.packed``: mxfp4, int4), as a module of moecomp's own.

transformers has no 4-bit experts module that runs without the hub (gpt-oss's ``Mxfp4GptOssExperts`` needs the
hub's Triton kernels; without them transformers dequantizes to bf16 at load time), so the loaders (``formats/mxfp4.py``,
``api/load_gptq.py``) put this module where a block's experts were. It holds the packed tensors as stored (nothing
dequantized is kept) and computes, in plain PyTorch, the dequantized reference of ``moecomp.oracle.reference.experts``:

    experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H] in hidden_states' dtype
        per expert e hit:  h = x @ deq(w13[e]).T (+ b13[e]);  h = act(gate, up);  y = h @ deq(w2[e]).T (+ b2[e])
        out[t] += top_k_weights[t, j] * y          (fp32 accumulation, as the reference)

    w13 [E, N, H / 2] uint8 (N = 2I gated: gate / up "concat" or "interleaved" rows), w2 [E, H, I / 2] uint8,
    w13_scale [E, N, H / g], w2_scale [E, H, I / g] (ue8m0 for mxfp4; fp32 / fp16 / bf16 for int4),
    w13_zero / w2_zero uint8 of the scales' shapes (int4 with zero points), b13 [E, N] / b2 [E, H] optional.

A weight goes through ``torch.ops.moecomp.dequant_4bit(q, scale, zero, quant)`` (fp32), moecomp's tracing
vocabulary for 4-bit weights (as ``dequant_fp8`` is for FP8): one node whose inputs are the packed tensors.
``optimize`` binds a block holding this module to ``moe_forward`` with ``spec.quant`` set, reading the packed
tensors in place.

Layout (``QuantSpec.layout``; docs/QUANT4.md). ``set_layout("mma")`` re-lays w13 / w2 in place (``ops/w4_layout.py``:
each expert's 32-bit words rewritten in the same storage, one expert's temporaries at a time; never a second copy)
and sets ``quant.layout``; ``set_layout("packed")`` restores the packed bytes exactly. ``optimize`` does it to every
``PackedExperts`` that can take it when MOECOMP_W4_FORM=mma (``relayout_experts``), before the checks run, and
``unoptimize`` restores them. While re-laid, everything that reads the codes goes by the layout: ``dequant_4bit``
(this module's forward) reads the mma bytes back to packed ones per expert (a copy of that expert's bytes), the op's
Triton path reads them as they are, ``state_dict()`` holds the packed bytes (copies, made at that call), and
``load_state_dict`` takes packed bytes (a checkpoint's) and re-lays them as it loads.
"""

from __future__ import annotations

import torch
from torch import nn

import dataclasses

from ..core import quant as q8
from ..oracle import reference
from ..core.spec import QuantSpec, SpecError
from ..core.spec_checks import W4_LAYOUTS
from ..ops import w4_layout

CODES = ("w13", "w2")  # the 4-bit code tensors (a layout re-lays these; scales and zeros are read as stored)


@torch.library.custom_op("moecomp::dequant_4bit", mutates_args=())
def dequant_4bit(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, quant: str) -> torch.Tensor:
    """[..., rows, cols / 2] 4-bit codes in ``quant``'s layout + group scales (+ int4 zeros) -> fp32 [..., rows,
    cols] (the mma layout read back to packed bytes first: ``w4_layout.unpack``)."""
    q, qs = w4_layout.unpack(q, QuantSpec.from_key(quant))
    return q8.dequantize(q, scale, qs, zero=zero)


@dequant_4bit.register_fake
def _(q, scale, zero, quant):
    return q.new_empty((*q.shape[:-1], 2 * q.shape[-1]), dtype=torch.float32)


def unpacked_shape(module: nn.Module, t: torch.Tensor) -> tuple:
    """The logical shape of ``module``'s tensor ``t``: a ``PackedExperts``' packed weights (uint8, two codes a byte
    along the last dim) with that dim doubled; any other tensor's own shape."""
    shape = tuple(t.shape)
    if isinstance(module, PackedExperts) and t.dtype == torch.uint8 and (t is module.w13 or t is module.w2):
        return shape[:-1] + (2 * shape[-1],)
    return shape


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class PackedExperts(nn.Module):
    """Routed experts in a 4-bit format (module docstring). ``activation`` / ``activation_alpha`` /
    ``activation_limit`` / ``activation_clamp`` / ``gate_up`` mean what they mean on ``MoESpec``."""

    def __init__(self, quant: QuantSpec, w13, w13_scale, w2, w2_scale, w13_zero=None, w2_zero=None, b13=None,
                 b2=None, *, gate_up: str = "concat", activation: str = "silu", gated: bool = True,
                 activation_alpha: float = 1.702, activation_limit: float = 7.0, activation_clamp: bool = False):
        super().__init__()
        if not isinstance(quant, QuantSpec) or not quant.packed:
            raise SpecError(f"quant must be a 4-bit QuantSpec (mxfp4 or int4), got {quant!r}")
        self.quant = quant
        self._quant_key = quant.key  # (read outside any trace: Dynamo cannot trace a cached property's first read)
        self.num_experts = int(w13.shape[0])
        self.hidden_size = int(w2.shape[1])
        self.intermediate_size = int(w2.shape[2]) * 2
        self.gate_up, self.activation, self.gated = gate_up, activation, gated
        self.activation_alpha, self.activation_limit = activation_alpha, activation_limit
        self.activation_clamp = activation_clamp
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale),
                        ("w13_zero", w13_zero), ("w2_zero", w2_zero), ("b13", b13), ("b2", b2)):
            setattr(self, name, _frozen(t))
        self.spec().validate()
        (getattr(self, "register_state_dict_post_hook", None) or self._register_state_dict_hook)(_packed_state)
        if hasattr(self, "register_load_state_dict_pre_hook"):
            self.register_load_state_dict_pre_hook(_relay_on_load)
        else:  # (torch < 2.5)
            self._register_load_state_dict_pre_hook(_relay_on_load, with_module=True)
        from ..ops.moe_op import check_args

        x = torch.empty(0, self.hidden_size, dtype=torch.bfloat16, device=w13.device)
        check_args(x, self.tensors(), self.spec())  # shapes and dtypes: a ValueError naming the tensor

    def spec(self, top_k: int = 1):
        """The experts' part of a MoESpec (routing left at its defaults; ``top_k`` as given)."""
        from ..core.spec import MoESpec, expert_bias_fields

        return MoESpec(num_experts=self.num_experts, top_k=top_k, hidden_size=self.hidden_size,
                       intermediate_size=self.intermediate_size, activation=self.activation, gated=self.gated,
                       gate_up=self.gate_up, activation_alpha=self.activation_alpha,
                       activation_limit=self.activation_limit, activation_clamp=self.activation_clamp,
                       quant=self.quant, **expert_bias_fields(self.b13 is not None, self.b2 is not None))

    def tensors(self) -> dict:
        """The op's expert arguments by name (``EXPERT_ARGS`` + scales / zeros where held)."""
        names = ("w13", "b13", "w2", "b2", "w13_scale", "w2_scale", "w13_zero", "w2_zero")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None or n in ("b13", "b2")}

    def set_layout(self, layout: str) -> bool:
        """w13 / w2 re-laid in place to ``layout`` ("packed" | "mma": the module docstring) and ``quant.layout`` set;
        whether anything changed. A ValueError naming the tensor (before either is touched) when one cannot take it
        (K not a multiple of 8, not contiguous, not 4-byte aligned)."""
        if layout not in W4_LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {W4_LAYOUTS}")
        if layout == self.quant.layout:
            return False
        for name in CODES:
            w4_layout.check_in_place(getattr(self, name), self.quant, name)
        fn = w4_layout.relayout_ if layout == "mma" else w4_layout.restore_
        with torch.no_grad():
            for name in CODES:
                fn(getattr(self, name).detach(), self.quant)  # (detach: the same storage and version counter)
        self.quant = dataclasses.replace(self.quant, layout=layout)
        self._quant_key = self.quant.key
        return True

    def dequantized(self, name: str, e) -> torch.Tensor:
        """fp32 weight ``name`` ("w13" / "w2") of expert(s) ``e`` (an index, or each pair's expert [S]: [S, rows,
        cols])."""
        zero = getattr(self, f"{name}_zero")
        return torch.ops.moecomp.dequant_4bit(getattr(self, name)[e], getattr(self, f"{name}_scale")[e],
                                              None if zero is None else zero[e], self._quant_key)

    def _gate_up(self, h: torch.Tensor) -> torch.Tensor:
        """h [S, N] fp32 after the first GEMM (and its bias) -> the second GEMM's input [S, I] (``MoESpec`` meaning
        of ``gate_up`` / ``activation`` / ``activation_alpha`` / ``activation_limit`` / ``activation_clamp``)."""
        if not self.gated:
            return reference.activation(h, self.activation)
        I = self.intermediate_size
        gate, up = (h[:, :I], h[:, I:]) if self.gate_up == "concat" else (h[:, 0::2], h[:, 1::2])
        return reference.gated_activation(gate, up, self.activation, self.activation_alpha, self.activation_limit,
                                          self.activation_clamp)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """Eagerly a loop over the experts hit (one expert dequantized at a time); while Dynamo traces, one batched
        spelling (each pair's weights gathered ``w[ids]``, dequantized, ``bmm``) that traces into one graph of
        ``dequant_4bit`` nodes the FX pass reads (``recognise/fx/moe_quant.py``). Both: fp32 GEMMs, h rounded to the
        input dtype between them (as the kernels store it), the routing weights applied and summed in fp32."""
        x = hidden_states.reshape(-1, self.hidden_size)
        ids = top_k_index.reshape(x.shape[0], -1)
        weights = top_k_weights.reshape(x.shape[0], -1)
        if torch.compiler.is_compiling():
            out = self._forward_batched(x, ids, weights)
        else:
            out = self._forward_loop(x, ids, weights)
        return out.to(hidden_states.dtype).reshape(hidden_states.shape)

    def _forward_loop(self, x, ids, weights) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            if not 0 <= e < self.num_experts:  # expert-parallel sentinels (other ranks' experts)
                continue
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            h = x[tok].float() @ self.dequantized("w13", e).T  # [n, N]
            if self.b13 is not None:
                h = h + self.b13[e].float()
            h = self._gate_up(h).to(x.dtype).float()  # [n, I]
            y = h @ self.dequantized("w2", e).T  # [n, H]
            if self.b2 is not None:
                y = y + self.b2[e].float()
            out.index_add_(0, tok, y * weights[tok, slot, None].float())
        return out

    def _forward_batched(self, x, ids, weights) -> torch.Tensor:
        T, k = ids.shape
        eid = ids.reshape(-1)  # [S = T k]
        xs = x.repeat_interleave(k, dim=0).float()  # [S, H]
        h = torch.bmm(self.dequantized("w13", eid), xs.unsqueeze(-1)).squeeze(-1)  # [S, N]
        if self.b13 is not None:
            h = h + self.b13[eid].float()
        h = self._gate_up(h).to(x.dtype).float()  # [S, I]
        y = torch.bmm(self.dequantized("w2", eid), h.unsqueeze(-1)).squeeze(-1)  # [S, H]
        if self.b2 is not None:
            y = y + self.b2[eid].float()
        y = y * weights.reshape(-1, 1).float()
        return y.view(T, k, self.hidden_size).sum(dim=1)


def _packed_state(module: PackedExperts, state_dict, prefix: str, local_metadata) -> None:
    """``state_dict()`` of a re-laid module: its codes as packed bytes (copies; the checkpoint format)."""
    if module.quant.layout != "packed":
        for name in CODES:
            if prefix + name in state_dict:
                state_dict[prefix + name] = w4_layout.restore(state_dict[prefix + name].detach(), module.quant)


def _relay_on_load(module: PackedExperts, state_dict, prefix: str, *args) -> None:
    """``load_state_dict`` into a re-laid module: the incoming packed codes re-laid (copies) before they are loaded."""
    if module.quant.layout != "packed":
        for name in CODES:
            if prefix + name in state_dict:
                state_dict[prefix + name] = w4_layout.relayout(state_dict[prefix + name], module.quant)


def relayout_experts(model: nn.Module, layout: str, only_relaid: bool = False) -> list[str]:
    """Every ``PackedExperts`` of ``model`` set to ``layout`` (``set_layout``) where it can take it (its tensors
    checked by ``w4_layout.check_in_place``; meta tensors skipped); ``only_relaid``: only those an earlier call
    re-laid (marked ``_moecomp_relaid``). The names of the modules changed."""
    done = []
    for name, m in model.named_modules():
        if not isinstance(m, PackedExperts) or (only_relaid and not m.__dict__.get("_moecomp_relaid")):
            continue
        if any(getattr(m, n).is_meta for n in CODES):
            continue
        try:
            for n in CODES:
                w4_layout.check_in_place(getattr(m, n), m.quant, n)
        except ValueError:
            continue  # (this one keeps its layout: the op runs the device's default form on packed weights)
        if m.set_layout(layout):
            m.__dict__["_moecomp_relaid"] = layout != "packed"
            done.append(name)
    return done
