"""The ``Report`` of ``moecomp.optimize`` / ``moecomp.scan``: one ``BlockReport`` per candidate MoE block, and its
text (``str(report)``: a table) and JSON (``report.to_json()``) forms."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.reject import RejectCode
from ..core.spec import MoESpec
from ..core.status import BlockStatus
from ..bind import bind as _bind
from ..core.derived import get_path


def router_style(spec: MoESpec) -> str:
    if spec.score_order == "topk_then_score":
        s = f"top-k→{spec.scoring}"
    elif spec.score_order == "sparsemixer":
        s = f"sparsemixer ε={spec.jitter_eps:g}" + (" renorm" if spec.renormalize else "")
    else:
        s = {"softmax": "softmax", "sigmoid": "sigmoid", "sqrtsoftplus": "sqrt-softplus", "none": "logits"}[
            spec.scoring]
        if spec.has_correction_bias:
            s += "+bias" if not spec.bias_on_logits else " (bias on logits)"
        if spec.n_group > 1:
            s += f" group {spec.topk_group}/{spec.n_group}" + ("" if spec.group_score == "top2_sum" else " max")
            if spec.group_mask_zero:
                s += " mask 0"
        s += "→hash table" if spec.hash_routing else "→top-k"
        if spec.renormalize:
            s += " renorm" + (f" (min {spec.renorm_min:g})" if spec.renorm_min > 0 else "")
    if spec.has_router_bias:
        s = "linear+b " + s
    if spec.routed_scaling_factor != 1.0:
        s += f" ×{spec.routed_scaling_factor:g}"
    if spec.weight_on_input:
        s += " on input"
    if spec.zero_experts:
        s += f" +{spec.zero_experts} zero"
    if spec.has_capacity:
        s += f" capacity {spec.capacity or f'{spec.capacity_factor:g}·tokens'} per {spec.capacity_per}" + (
            " (renorm after drop)" if spec.renorm_after_drop else "")
    if spec.router_prefix:  # the router's own input, normalised / scaled before its GEMM
        pre = ("own input" if spec.router_input else "x") + (" rms" if spec.router_norm else "") + (
            " ×s[H]" if spec.router_in_scale else "") + (
            f" ×{spec.router_in_const:.4g}" if spec.router_in_const != 1.0 else "")
        s = f"({pre}) " + s
    if spec.expert_scale:
        s += " ×s[e]"
    return s


def expert_style(spec: MoESpec) -> str:
    a = spec.activation
    q = spec.quant
    if spec.gated and a != "swiglu_oai":
        a = f"{a}·up"
    if spec.activation_clamp:
        a = f"clamp{spec.activation_limit:g} {a}"
    if spec.activation_clamp_after:
        a = f"act-clamp{spec.activation_limit:g} {a}"
    if spec.gate_softcap or spec.up_softcap:
        a = f"softcap(g {spec.gate_softcap:g}, up {spec.up_softcap:g}) {a}"
    if spec.gate_up == "interleaved":
        a += " interleaved"
    if spec.has_expert_bias:
        a += {"both": " +b", "gemm1": " +b13", "gemm2": " +b2"}[spec.expert_bias]
    if spec.w_layout == "in_out":
        a += " [in,out]"
    if spec.latent_size:
        a += f" latent L={spec.latent_size}"
    if q is not None and q.packed:  # 4-bit weight-only: format, group size, zero points
        a = f"4-bit {q.weight} g{q.block_k}{' +zero' if q.zero_point else ''} {a}"
    elif q is not None:
        lay = f"{q.block_n}x{q.block_k}" if q.scale == "block" else q.scale
        a = f"fp8 {lay} a:{'token' if q.per_token else q.activation} {a}"
    return a


def _itemsize(t: torch.Tensor | None, default=2) -> int:
    return default if t is None else t.element_size()


@dataclass
class BlockReport:
    name: str
    cls: str
    status: BlockStatus  # (core/status.py; its text accepted when constructed)
    reason: str = ""
    method: str = ""  # fx | fallback | fallback (meta)
    spec: MoESpec | None = None
    num_experts: int | None = None
    top_k: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    shared: str = "-"
    router: str = ""
    experts: str = ""
    bytes_per_token: int | None = None
    extra_bytes: int = 0  # memory for weight copies (separate 3-D gate / up, fp32 routers); shared stacks: 0
    max_rel_err: float | None = None
    epilogue: list = field(default_factory=list)  # child modules applied to the op's output (e.g. a post-MoE norm)
    notes: list = field(default_factory=list)
    codes: list = field(default_factory=list)  # RejectCode of each refusal (``reason`` is the text for people)

    def __post_init__(self):
        try:
            self.status = BlockStatus(self.status)  # (its text is accepted: "skipped")
        except ValueError:
            raise ValueError(f"BlockReport: status must be a BlockStatus or its text "
                             f"({', '.join(s.value for s in BlockStatus)}), got {self.status!r}") from None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["status"] = str(self.status)
        d["spec"] = None if self.spec is None else json.loads(self.spec.key)
        d["codes"] = [c.value for c in self.codes]
        return d

    def refuse(self, code: RejectCode, reason: str) -> None:
        """Record a refusal: ``reason`` (report text) replaces the current one, ``code`` is added to ``codes``."""
        self.reason = reason
        self.codes.append(code)


def fill_from_spec(r: BlockReport, spec: MoESpec, block: nn.Module, bindings: dict, derived) -> None:
    r.spec = spec
    r.num_experts, r.top_k, r.hidden, r.intermediate = (spec.num_experts, spec.top_k, spec.hidden_size,
                                                       spec.intermediate_size)
    if spec.shared is not None:
        sh = spec.shared
        r.shared = f"I={sh.intermediate_size}" + (" sigmoid-gated" if sh.gate == "sigmoid" else "")
    r.router = router_style(spec)
    r.experts = expert_style(spec)

    def t(name):
        p = bindings.get(name)
        if p is None:
            return None
        try:
            return get_path(block, p)
        except AttributeError:
            return None

    w13 = t("w13")
    if w13 is None and derived:  # stacked: size from the first source
        src = get_path(block, derived[0].source_paths()[0])
        isz = src.element_size()
    else:
        isz = _itemsize(w13)
    if spec.quant is not None and spec.quant.packed:  # two codes a byte (+ scales); the rest at the bias' size
        per_tok = spec.top_k * spec.bytes_per_expert()
        isz = _itemsize(t("b13"), _itemsize(t("router_w")))
    else:
        per_tok = spec.top_k * spec.bytes_per_expert(isz)
    if spec.has_expert_bias:
        per_tok += spec.top_k * (spec.w13_rows * spec.has_b13 + spec.expert_width * spec.has_b2) * isz
    if spec.latent_size:  # the two latent projections, [L, H] and [H, L]
        per_tok += 2 * spec.latent_size * spec.hidden_size * _itemsize(t("latent_in_w"), isz)
    rw = t("router_w")
    per_tok += spec.router_width * spec.hidden_size * _itemsize(rw, isz)
    if spec.shared is not None:
        Is = spec.shared.intermediate_size
        n = (3 if spec.shared.gated else 2) * Is * spec.hidden_size
        if spec.shared.gate == "sigmoid":
            n += spec.hidden_size
        per_tok += n * _itemsize(t("shared_w2"), isz)
    r.bytes_per_token = int(per_tok)
    # shared stacks hold no second copy, nor do views ("rows": the E experts of an [E + Z, ...] weight; "view": flat
    # experts read as [E, ., .])
    copies = [d for d in derived if not _bind.is_shared(block, d) and not d.is_view]
    if copies:
        r.extra_bytes = int(sum(
            sum(get_path(block, p).numel() for p in d.source_paths()) * (4 if d.fp32 else isz) for d in copies))


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class Report:
    """What ``optimize`` / ``scan`` found: one row per candidate MoE block. ``str(report)`` is a table."""

    model: str
    blocks: list[BlockReport]
    detection: str = ""  # how blocks were detected (FX pass available or not)
    action: str = "scan"  # scan | optimize
    generate: str = ""  # what model.generate does after optimize ("" = transformers' own)
    # FP8Linear-like modules (attention, dense MLPs, shared experts): {"modules": n, "bound": n (to
    # moecomp.ops.fp8_linear), "refused": {name: why}}
    fp8_linear: dict = field(default_factory=dict)
    # PackedExperts re-laid in place to the 4-bit "mma" layout before the checks (MOECOMP_W4_FORM=mma; QuantSpec.layout)
    w4_relaid: list = field(default_factory=list)

    @property
    def rewritten(self) -> list[BlockReport]:
        return [b for b in self.blocks if b.status in (BlockStatus.REWRITTEN, BlockStatus.ALREADY)]

    @property
    def experts_only(self) -> list[BlockReport]:
        """Blocks left as they are except for their experts module, which runs ``moe_experts``."""
        return [b for b in self.blocks if b.status == BlockStatus.EXPERTS_ONLY]

    @property
    def skipped(self) -> list[BlockReport]:
        return [b for b in self.blocks if b.status == BlockStatus.SKIPPED]

    def summary(self) -> dict:
        from collections import Counter

        c = Counter(str(b.status) for b in self.blocks)  # (keys: the statuses' text)
        return {"blocks": len(self.blocks), **dict(c)}

    def to_dict(self) -> dict:
        return {"model": self.model, "action": self.action, "detection": self.detection, "generate": self.generate,
                "summary": self.summary(), "blocks": [b.to_dict() for b in self.blocks],
                "fp8_linear": dict(self.fp8_linear)}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **({"indent": 2} | kw))

    def __str__(self) -> str:
        head = ["block", "router", "E", "k", "H", "I", "shared", "experts", "status", "bytes/token"]
        rows = []
        for b in self.blocks:
            st = str(b.status)
            if b.reason:
                st += f": {b.reason}"
            if b.method and b.status != BlockStatus.SKIPPED:
                st += f" [{b.method}]"
            if b.epilogue:
                st += f" then {', '.join(b.epilogue)}"
            rows.append([b.name or "<root>", b.router or "-", *(str(v) if v is not None else "-" for v in (
                b.num_experts, b.top_k, b.hidden, b.intermediate)), b.shared, b.experts or "-", st,
                _fmt_bytes(b.bytes_per_token)])
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
        widths[8] = min(widths[8], 70)
        line = lambda r: "  ".join(str(c)[:widths[i]].ljust(widths[i]) if i != 8 else str(c)  # noqa: E731
                                   for i, c in enumerate(r)).rstrip()
        out = [f"moecomp {self.action}: {self.model} — {len(self.blocks)} MoE block(s) "
               f"{self.summary()}", self.detection] if self.detection else [
            f"moecomp {self.action}: {self.model} — {len(self.blocks)} MoE block(s) {self.summary()}"]
        out.append(line(head))
        out.append(line(["-" * w for w in widths]))
        out += [line(r) for r in rows]
        extra = sum(b.extra_bytes for b in self.blocks if b.status in (BlockStatus.REWRITTEN, BlockStatus.ALREADY))
        if extra:
            out.append(f"weight copies (separate 3-D gate and up, fp32 router copies) use {_fmt_bytes(extra)} extra "
                       f"memory")
        fl = self.fp8_linear
        if fl.get("modules"):
            out.append(f"FP8 linears (attention, dense MLPs, shared experts): {fl['modules']}, "
                       f"{fl['bound']} bound to moecomp.fp8_linear" + (
                           f", {len(fl['refused'])} refused: " + "; ".join(list(fl["refused"].values())[:2])
                           if fl.get("refused") else ""))
        if self.generate:
            out.append(f"generate(): {self.generate}")
        return "\n".join(out)

    __repr__ = __str__
