"""compressed-tensors checkpoints (llm-compressor's format, ``quant_method: "compressed-tensors"``) read by meaning.

What a scheme means comes from the checkpoint's ``quantization_config`` (``config_groups``: each a scheme, or a preset
name, with ``targets``; the global ``ignore``), what a tensor holds from its dtype and shape; family and class names
are not read (a ``targets`` entry that is not a ``re:`` pattern matches every linear, as compressed-tensors' "Linear"
does). Read, for one linear of weight W [N, K] (docs/FP8.md and docs/QUANT4.md, "compressed-tensors"):

    FP8-dynamic ("float-quantized"; weights float 8-bit "channel", input activations float 8-bit "token" dynamic)
        weight        float8_e4m3fn [N, K]     the codes, kept as they are (the op reads them in place)
        weight_scale  [N, 1] fp32 / bf16 / fp16 one scale per output row -> fp32 [N] (exact: a copy of N values)
        -> QuantSpec(scale="channel", activation="dynamic", act_group=0): activations quantized per token, over the
           whole row (``QuantSpec.per_token``); without input activations the same weights run weight-only
    FP8 block ("FP8_BLOCK": weights "block" [128, 128], activations "group" 128 dynamic)
        weight_scale  [ceil(N / 128), ceil(K / 128)] -> fp32; QuantSpec(scale="block") (DeepSeek's layout)
    W4A16 ("pack-quantized"; weights int 4-bit "group", group size g a multiple of 32, no input activations)
        weight_packed int32 [N, K / 8]         code i of a word in bits 4i..4i+3 (code = q + 8): on a little-endian
                                               machine its bytes are moecomp's int4 layout already (``.view(uint8)``
                                               [N, K / 2], code of input 2j in the low nibble of byte j): no repack
        weight_scale  [N, K / g] fp32 / bf16 / fp16, kept as stored
        weight_zero_point int32 [N / 8, K / g] (asymmetric only) packed along N -> uint8 [N, K / g] (a copy of the
                                               small zero tensor: moecomp keeps one zero byte per row and group)
        weight_shape  int64 [2] = [N, K]
        -> QuantSpec.int4(g, zero_point=not symmetric): w = (code - zero) * scale, zero 8 when symmetric

Everything else is refused with a reason code (``CTUnsupported.code``, one of ``REASONS``): FP8 with static or
per-tensor activation scales, int8 weights, int4 with channel / per-tensor scales or activation quantization, act-order
(``weight_g_idx``), NVFP4 / MXFP4 and other floating 4-bit formats, KV-cache schemes on their own, other formats.

A routed expert's projections (``experts.{e}.{gate,up,down}_proj`` or ``w1 / w3 / w2``) are stacked into the op's
fused layout once at load (w13 [E, 2I, ...] = gate rows then up rows, w2 [E, H, ...]): the codes are moved, never
turned into floats. The loader is ``moecomp.api.load_compressed`` (it finds the MoE blocks by structure).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core import quant as q8
from ..core.spec import QuantSpec

FP8 = torch.float8_e4m3fn
FLOAT_SCALES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
FP8_SUFFIXES = ("weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
SUFFIXES = tuple(dict.fromkeys(INT4_SUFFIXES + FP8_SUFFIXES + ("weight_global_scale", "input_global_scale")))
MAINS = ("weight_packed", "weight_scale")  # a prefix holding one of these is a quantized linear

# reason code -> what it means (the message of a CTUnsupported says more)
REASONS = {
    "ct_not_compressed_tensors": "the quantization_config is not compressed-tensors'",
    "ct_format": "a compression format other than float-quantized / pack-quantized / naive-quantized",
    "ct_fp8_static": "FP8 with static (calibrated) activation scales",
    "ct_fp8_scales": "FP8 weight scales other than per channel or 128 x 128 blocks",
    "ct_int8": "8-bit integer weights (W8A8 / W8A16 int8)",
    "ct_int4_layout": "int4 without group scales, a group that is not a multiple of 32, or activation quantization",
    "ct_actorder": "act-order int4 (weight_g_idx): groups scattered along K",
    "ct_float4": "a floating 4-bit format (NVFP4, MXFP4) or other bit widths",
    "ct_bad_tensors": "the stored tensors do not fit the scheme",
    "ct_transformers_layout": "a linear as transformers' compressed-tensors path holds it (decompressed on the first "
                              "forward): read through moecomp.load instead",
}

# compressed-tensors' preset names a config group may give instead of a scheme (the ones read here and their
# neighbours that are refused by meaning: their schemes are spelled out, nothing is imported from the package)
_W = dict(type="float", num_bits=8, symmetric=True, dynamic=False)
PRESETS = {
    "FP8_DYNAMIC": dict(weights=dict(_W, strategy="channel"),
                        input_activations=dict(_W, strategy="token", dynamic=True)),
    "FP8_BLOCK": dict(weights=dict(_W, strategy="block", block_structure=[128, 128]),
                      input_activations=dict(_W, strategy="group", group_size=128, dynamic=True)),
    "FP8": dict(weights=dict(_W, strategy="tensor"), input_activations=dict(_W, strategy="tensor")),
    "W4A16": dict(weights=dict(type="int", num_bits=4, symmetric=True, strategy="group", group_size=128)),
    "W4A16_ASYM": dict(weights=dict(type="int", num_bits=4, symmetric=False, strategy="group", group_size=128)),
    "W8A16": dict(weights=dict(type="int", num_bits=8, symmetric=True, strategy="channel")),
    "W8A8": dict(weights=dict(type="int", num_bits=8, symmetric=True, strategy="channel"),
                 input_activations=dict(type="int", num_bits=8, symmetric=True, strategy="token", dynamic=True)),
}


class CTUnsupported(ValueError):
    """A compressed-tensors scheme or tensor moecomp does not read; ``code`` is one of ``REASONS``."""

    def __init__(self, code: str, message: str):
        assert code in REASONS, code
        self.code = code
        super().__init__(f"[{code}] {message}")


# ------------------------------------------------------------------------------------------------ schemes
@dataclass(frozen=True)
class Args:
    """One side of a scheme (compressed-tensors' ``QuantizationArgs``, the fields read here)."""

    type: str = "int"
    num_bits: int = 8
    strategy: str | None = None
    group_size: int | None = None
    symmetric: bool = True
    dynamic: bool | str = False
    block_structure: tuple | None = None
    actorder: str | None = None

    @staticmethod
    def read(a) -> "Args | None":
        """From a dict (config.json) or an object with the same attributes (the package's ``QuantizationArgs``)."""
        if a is None:
            return None
        get = a.get if isinstance(a, dict) else (lambda k, d=None: getattr(a, k, d))
        val = lambda v: getattr(v, "value", v)  # noqa: E731  (the package's enums)
        bs = get("block_structure")
        return Args(type=str(val(get("type", "int"))), num_bits=int(get("num_bits", 8)),
                    strategy=None if get("strategy") is None else str(val(get("strategy"))),
                    group_size=get("group_size"), symmetric=bool(get("symmetric", True)),
                    dynamic=val(get("dynamic", False)), block_structure=None if bs is None else tuple(bs),
                    actorder=None if get("actorder") is None else str(val(get("actorder"))))


@dataclass(frozen=True)
class Scheme:
    """A compressed-tensors quantization scheme (weights, input activations) and what moecomp makes of it."""

    weights: Args | None
    inputs: Args | None = None

    @staticmethod
    def read(s) -> "Scheme":
        get = s.get if isinstance(s, dict) else (lambda k, d=None: getattr(s, k, d))
        return Scheme(Args.read(get("weights")), Args.read(get("input_activations")))

    def kind(self) -> str:
        """"fp8" or "int4" (what the op runs), else CTUnsupported with its reason code."""
        w, a = self.weights, self.inputs
        if w is None:
            raise CTUnsupported("ct_format", "a scheme without weight quantization (activations or KV cache only)")
        if w.type == "float" and w.num_bits == 8:
            if w.strategy not in ("channel", "block"):
                raise CTUnsupported("ct_fp8_scales", f"FP8 weights with strategy {w.strategy!r} scales")
            if w.strategy == "block" and tuple(w.block_structure or ()) != (128, 128):
                raise CTUnsupported("ct_fp8_scales", f"FP8 block scales of {w.block_structure}: only 128 x 128")
            if a is not None:
                if not (a.type == "float" and a.num_bits == 8 and a.dynamic is True):
                    raise CTUnsupported("ct_fp8_static", f"FP8 input activations {a.type} {a.num_bits}-bit, "
                                        f"dynamic={a.dynamic!r}: only dynamic e4m3 activations are read")
                if a.strategy not in ("token", "group") or a.strategy == "group" and a.group_size != 128:
                    raise CTUnsupported("ct_fp8_static", f"FP8 dynamic activations per {a.strategy!r} "
                                        f"(group_size {a.group_size}): per token or per 128 columns are read")
            return "fp8"
        if w.type == "int" and w.num_bits == 8:
            raise CTUnsupported("ct_int8", "int8 weights")
        if w.type == "int" and w.num_bits == 4:
            if w.actorder not in (None, "static", "weight"):
                raise CTUnsupported("ct_actorder", f"int4 with actorder={w.actorder!r}")
            if w.strategy != "group" or not w.group_size or w.group_size % 32 or a is not None:
                raise CTUnsupported("ct_int4_layout", f"int4 weights with strategy {w.strategy!r}, group_size "
                                    f"{w.group_size}, input activations {a}")
            return "int4"
        raise CTUnsupported("ct_float4", f"{w.type} {w.num_bits}-bit weights")

    def quant(self, scale_dtype: torch.dtype = torch.float32) -> QuantSpec:
        """The op's QuantSpec (FP8 scales are read as fp32; int4 keeps ``scale_dtype``)."""
        w, a = self.weights, self.inputs
        if self.kind() == "int4":
            if scale_dtype not in FLOAT_SCALES:
                raise CTUnsupported("ct_bad_tensors", f"int4 scales of dtype {scale_dtype}: fp32 / bf16 / fp16")
            return QuantSpec.int4(w.group_size, zero_point=not w.symmetric, scale_dtype=FLOAT_SCALES[scale_dtype])
        act = dict(activation="none") if a is None else dict(activation="dynamic",
                                                             act_group=0 if a.strategy == "token" else 128)
        if w.strategy == "block":
            return QuantSpec(scale="block", block_n=128, block_k=128, **act)
        return QuantSpec(scale="channel", **act)


def scheme_of(m: nn.Module) -> Scheme | None:
    """The compressed-tensors scheme a module carries: moecomp's loader's (``ct_scheme``) or the one compressed-tensors
    attaches to the modules of a model transformers loaded (``quantization_scheme``); None for others."""
    s = m.__dict__.get("ct_scheme")
    if isinstance(s, Scheme):
        return s
    s = getattr(m, "quantization_scheme", None)
    if s is None or not hasattr(s, "weights"):
        return None
    try:
        return Scheme.read(s)
    except (TypeError, ValueError):
        return None


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    # a class name ("Linear"): every quantized tensor in a checkpoint belongs to a linear; else a module's name
    return target == name or (target[:1].isupper() and "." not in target)


@dataclass
class Config:
    """A checkpoint's compressed-tensors ``quantization_config``."""

    groups: list = field(default_factory=list)  # [(targets, Scheme)]
    ignore: tuple = ()
    format: str = "dense"

    @staticmethod
    def read(qc) -> "Config":
        if qc is not None and not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        if not qc or str(qc.get("quant_method", "")).lower() != "compressed-tensors":
            raise CTUnsupported("ct_not_compressed_tensors", f"quant_method={(qc or {}).get('quant_method')!r}")
        groups = []
        for name, g in (qc.get("config_groups") or {}).items():
            if isinstance(g, list):  # {preset name: targets}
                if name not in PRESETS:
                    raise CTUnsupported("ct_format", f"config group preset {name!r} (known: {sorted(PRESETS)})")
                groups.append((tuple(g), Scheme.read(PRESETS[name])))
            else:
                groups.append((tuple(g.get("targets") or ()), Scheme.read(g)))
        fmt = str(qc.get("format") or "dense")
        return Config(groups, tuple(qc.get("ignore") or ()), fmt)

    def scheme_for(self, name: str) -> Scheme | None:
        """The scheme of linear ``name`` (the first group targeting it; None when ignored or not targeted). A
        ``re:`` target wins over a class-name one (compressed-tensors' precedence)."""
        if any(re.match(t[3:], name) if t.startswith("re:") else t == name for t in self.ignore):
            return None
        for regex in (True, False):
            for targets, scheme in self.groups:
                if any(t.startswith("re:") == regex and _matches(t, name) for t in targets):
                    return scheme
        return None


# ------------------------------------------------------------------------------------------------ tensors
def _bad(name: str, what: str) -> CTUnsupported:
    return CTUnsupported("ct_bad_tensors", f"{name}: {what}")


def fp8_tensors(t: dict, name: str, quant: QuantSpec) -> dict:
    """One FP8 linear's tensors -> {"w": e4m3 [N, K] (the stored tensor), "scale": fp32 [N] or [N / 128, K / 128]}."""
    w, s = t.get("weight"), t.get("weight_scale")
    if not isinstance(w, torch.Tensor) or w.dtype != FP8 or w.dim() != 2:
        raise _bad(f"{name}.weight", f"expected a float8_e4m3fn [N, K] tensor, got "
                   f"{getattr(w, 'dtype', type(w).__name__)} {list(getattr(w, 'shape', []))}")
    if not isinstance(s, torch.Tensor) or s.dtype not in FLOAT_SCALES:
        raise _bad(f"{name}.weight_scale", f"expected fp32 / bf16 / fp16 scales, got {getattr(s, 'dtype', s)}")
    N, K = w.shape
    want = tuple(quant.scale_shape(N, K))
    if quant.scale == "channel" and tuple(s.shape) in ((N, 1), (N,)):
        s = s.reshape(N)
    if tuple(s.shape) != want:
        raise _bad(f"{name}.weight_scale", f"shape {list(s.shape)}; {quant.scale} scales of weight [{N}, {K}] need "
                   f"{list(want)}")
    if "weight_zero_point" in t and bool((t["weight_zero_point"].float() != 0).any()):
        raise _bad(f"{name}.weight_zero_point", "non-zero FP8 zero points (asymmetric FP8 is not read)")
    return {"w": w, "scale": s.float()}


def _words_as_bytes(words: torch.Tensor) -> torch.Tensor:
    if sys.byteorder != "little":
        raise ValueError("compressed-tensors int4 tensors are read through a byte view of their int32 words: "
                         "little-endian only")
    return words.contiguous().view(torch.uint8)


def unpack_zero_points(zp: torch.Tensor, N: int, G: int, name: str) -> torch.Tensor:
    """int32 [ceil(N / 8), G] (packed along N, zero + 8 in bits 4i.. of word r for row 8r + i) -> uint8 [N, G]."""
    if zp.dtype != torch.int32 or tuple(zp.shape) != (-(-N // 8), G):
        raise _bad(name, f"{zp.dtype} {list(zp.shape)}; expected int32 [{-(-N // 8)}, {G}] (packed along N)")
    codes = q8.unpack_4bit(_words_as_bytes(zp.t()))  # [G, 8 ceil(N / 8)]
    return codes[:, :N].t().contiguous()


def int4_tensors(t: dict, name: str, quant: QuantSpec) -> dict:
    """One W4A16 linear's tensors -> {"w": uint8 [N, K / 2] (a view of weight_packed: no copy), "scale": [N, G] as
    stored, "zero": uint8 [N, G] or None}."""
    if "weight_g_idx" in t:
        raise CTUnsupported("ct_actorder", f"{name}.weight_g_idx: act-order int4")
    p, s, shape = t.get("weight_packed"), t.get("weight_scale"), t.get("weight_shape")
    if not isinstance(p, torch.Tensor) or p.dtype != torch.int32 or p.dim() != 2:
        raise _bad(f"{name}.weight_packed", f"expected int32 [N, K / 8], got {getattr(p, 'dtype', p)}")
    N, K = p.shape[0], 8 * p.shape[1]
    if isinstance(shape, torch.Tensor) and [int(v) for v in shape.reshape(-1).tolist()] != [N, K]:
        raise _bad(f"{name}.weight_shape", f"{shape.tolist()}; moecomp reads K a multiple of 8: weight_packed "
                   f"{list(p.shape)} holds [{N}, {K}]")
    G = -(-K // quant.block_k)
    if not isinstance(s, torch.Tensor) or s.dtype not in FLOAT_SCALES or tuple(s.shape) != (N, G):
        raise _bad(f"{name}.weight_scale", f"{getattr(s, 'dtype', s)} {list(getattr(s, 'shape', []))}; expected "
                   f"fp32 / bf16 / fp16 [{N}, {G}] (group {quant.block_k})")
    zp = t.get("weight_zero_point")
    if quant.zero_point != (zp is not None):
        raise _bad(f"{name}.weight_zero_point", f"{'missing' if zp is None else 'present'} but the scheme is "
                   f"{'asymmetric' if quant.zero_point else 'symmetric'}")
    zero = None if zp is None else unpack_zero_points(zp, N, G, f"{name}.weight_zero_point")
    return {"w": _words_as_bytes(p).view(N, K // 2), "scale": s, "zero": zero}


class Codec:
    """What the loader asks of a format (``moecomp.api.load_compressed``): one linear's tensors -> the op's."""

    def __init__(self, config: Config):
        self.config = config
        self.aliases: dict = {}  # the model's name of a linear -> the checkpoint's (targets / ignore name those)

    def scheme(self, name: str, t: dict) -> Scheme:
        """The scheme of the quantized linear ``name`` (its stored tensors ``t``); CTUnsupported when none fits."""
        s = self.config.scheme_for(self.aliases.get(name, name))
        if s is None:
            raise CTUnsupported("ct_bad_tensors", f"{name}: quantized tensors {sorted(t)} but no config group "
                                f"targets it (or it is ignored)")
        s.kind()
        return s

    def quant(self, name: str, t: dict) -> QuantSpec:
        s = self.scheme(name, t)
        sd = t["weight_scale"].dtype if isinstance(t.get("weight_scale"), torch.Tensor) else torch.float32
        return s.quant(sd if s.kind() == "int4" else torch.float32)

    def convert(self, t: dict, name: str) -> tuple[QuantSpec, dict]:
        q = self.quant(name, t)
        return q, (int4_tensors(t, name, q) if q.packed else fp8_tensors(t, name, q))

    def dequantize(self, t: dict, name: str) -> torch.Tensor:
        """fp32 W [N, K] of one linear (for a router the op reads 16-bit)."""
        q, c = self.convert(t, name)
        return q8.dequantize(c["w"], c["scale"], q, zero=c.get("zero"))
