"""Coverage, measured: every model family of the installed transformers whose experts use
``@use_experts_implementation`` is built tiny with random weights, optimized, and compared with itself.

    python -m moecomp coverage            # regenerates docs/coverage.md

Per family: build a tiny model from its config (hidden 64, 4 heads, 2 KV heads, 8 experts, top-2, 2 layers; a few
families need their own sizes, see ``FAMILY_OVERRIDES``; a *variant* ``family:name`` is the family's tiny model with
config changes that reach a style its default does not, see ``VARIANTS``), give routing biases random values (zeros would hide
bias handling), run it (fp32, CPU, batch 2 x 5 tokens), ``moecomp.optimize`` it, run it again and check

* the logits (or last hidden state) within 1e-4 relative (max abs difference / max abs value),
* exactly one ``torch.ops.moecomp.moe_forward`` call per rewritten block (counted with a TorchDispatchMode,
  attributed to blocks by forward hooks), and no call elsewhere;
* for blocks rewritten "experts only" (routing left to HF, the experts module switched to ``moe_experts``):
  exactly one ``torch.ops.moecomp.moe_experts`` call per call of that experts module, and none elsewhere.

A family that cannot be built tiny is listed with its error, not hidden.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.status import BlockStatus
from ..recognise import discover

TINY = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_intermediate_size=32, shared_experts_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8,
    num_experts_per_tok=2, moe_topk=2, top_k_experts=2,
    vocab_size=128, head_dim=16, max_position_embeddings=256, sliding_window=16,
    first_k_dense_replace=0, num_dense_layers=0, mlp_only_layers=[], decoder_sparse_step=1,
    n_group=4, topk_group=2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # MLA attention (DeepSeek-V2/V3 style)
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=16,  # Gemma-4 per-layer embeddings
)
MLA_KEYS = ("kv_lora_rank", "qk_rope_head_dim")

# Per-family config changes on top of TINY (found by building; each says why).
_MROPE = {"rope_type": "default", "rope_theta": 10000.0}
FAMILY_OVERRIDES: dict[str, dict] = {
    # the defaults make the first layers dense
    "beam": {"mlp_layer_types": ["sparse", "sparse"]},
    "deepseek_ocr2": {"mlp_layer_types": ["sparse", "sparse"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # no default layer pattern
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": 32},  # ZAYA supports top-1 only; its router MLP's width
    "dots1": {"n_shared_experts": 1},
    # DSA attention wants NoPE and as many KV heads as heads; small indexer
    "glm5_next": {"qk_rope_head_dim": 0, "mlp_layer_types": ["sparse", "sparse"], "index_topk": 16,
                  "index_head_dim": 16, "index_n_heads": 2, "index_kpool": 4, "num_key_value_heads": 4},
    "mistral4": {"head_dim": 32},  # head_dim = nope + rope dims
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]},  # one hash-routed layer, one top-k layer
    "gemma4": {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32},
    # multimodal RoPE sections must fit the tiny head dim
    "glm4v_moe": {"rope_parameters": {**_MROPE, "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}},
    "hy_v4_vl": {"num_key_value_heads": 4, "rope_parameters": {**_MROPE, "mrope_section": [4, 2, 2]}},
    "ernie4_5_vl_moe": {"moe_intermediate_size": [32, 32], "rope_parameters": {**_MROPE, "mrope_section": [3, 3, 2]}},
    # found by structure (recognise/discover.py): T5 / BART-style size fields
    "nllb_moe": {"d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "encoder_layers": 2,
                 "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                 "encoder_sparse_step": 1, "decoder_sparse_step": 1, "expert_capacity": 64},
    "switch_transformers": {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2,
                            "num_heads": 4, "encoder_sparse_step": 1, "decoder_sparse_step": 1,
                            "expert_capacity": 64},
    "jetmoe": {"kv_channels": 16},
    "ergo": {"num_hidden_layers": 3, "num_dense_blocks": 1, "first_dense_intermediate_size": 128},  # dense: 32768
    # LongCat-Flash has 256 zero experts per 512 routed ones; the default 256 beside the tiny 8 routed experts would
    # leave the routed ones nearly unreached
    "longcat_flash": {"zero_expert_num": 4, "expert_ffn_hidden_size": 32},  # 5.17 maps no TINY key onto the latter
    # Kolibri-1.1 (5.25): its indexer scores keys with index_num_heads (default 12) of the query heads of KV head 0,
    # and the config requires at most num_attention_heads / num_key_value_heads of them (4 / 2 here)
    "kolibri1_1": {"index_num_heads": 2},
    # Step-3.7 (5.25): layers from index 3 on are MoE by default (none of 2, so the text model had no experts and the
    # multimodal Step3p7Model, whose vision tower TINY does not shrink, was tried next); the shared expert's width
    # has its own field (share_expert_dim, 1280 by default)
    "step3p7": {"mlp_layer_types": ["sparse", "sparse"], "share_expert_dim": 32},
}

# Variants: ``family:name`` -> (family, config changes on top of its tiny config), checked and pinned like a family.
# Each reaches a block style the family's default tiny config does not (its own entry keeps its outcome).
VARIANTS: dict[str, tuple[str, dict]] = {
    # NemotronH with moe_latent_size: the routed experts between fc1_latent_proj [H -> L] and fc2_latent_proj
    # (MoESpec.latent_size); L = 48, neither H = 64 nor moe_intermediate_size = 32
    "nemotron_h:latent": ("nemotron_h", {"moe_latent_size": 48}),
    # Step-3.7-Flash's last MoE layers (43-44) clamp their SwiGLU after the activation: min(silu(g), L) * clamp(u, +-L)
    # (swiglu_limits, limit_after_act; MoESpec.activation_clamp_after), on the routed and the shared experts; L small
    # enough that the probes reach it
    "step3p7:limits": ("step3p7", {"swiglu_limits": [0.5, 0.5], "swiglu_limits_shared": [0.5, 0.5]}),
}

TOL = 1e-4
MAX_PARAMS = 20_000_000


def base_family(family: str) -> str:
    """The transformers family of ``family`` (itself, or a variant's family)."""
    return VARIANTS[family][0] if family in VARIANTS else family


def variants_of(families) -> list[str]:
    """The variants (``VARIANTS``) of the given families."""
    fams = set(families)
    return sorted(v for v, (base, _) in VARIANTS.items() if base in fams)


# ----------------------------------------------------------------------------------------------- families
def transformers_dir() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return os.path.dirname(transformers.__file__)


def experts_families() -> list[str]:
    """Model families whose modeling file uses ``@use_experts_implementation`` (source scan, no imports)."""
    return list(_experts_families())


@functools.lru_cache(maxsize=1)
def _experts_families() -> tuple:
    root = transformers_dir()
    if root is None:
        return ()
    out = []
    mdir = os.path.join(root, "models")
    for fam in sorted(os.listdir(mdir)):
        p = os.path.join(mdir, fam, f"modeling_{fam}.py")
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                if "@use_experts_implementation" in f.read():
                    out.append(fam)
    return tuple(out)


def _meta_build(family: str):
    """(model on the meta device, its config) from the first model class that builds tiny, or None."""
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for mc in _model_candidates(mod)[:2]:
        try:
            cfg = tiny_config(mc.config_class, family)
            with torch.device("meta"):
                return mc(cfg), cfg
        except Exception:  # the next candidate class
            continue
    return None


def _hidden_of(cfg) -> int | None:
    return getattr(cfg, "hidden_size", None) or getattr(getattr(cfg, "text_config", None), "hidden_size", None)


def moe_families() -> list[str]:
    """The families the coverage tool checks: those with ``@use_experts_implementation`` experts, and those whose
    tiny model has routed-experts blocks by structure (``recognise/discover.py``: a router [E, H] next to experts for it;
    no class or attribute names read). A structural candidate is confirmed at run time by ``check_family``."""
    import warnings

    import transformers

    root = transformers_dir()
    if root is None:
        return []
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = discover.structural_families(os.path.join(root, "models"), _meta_build, _hidden_of)
    finally:
        transformers.logging.set_verbosity(verbosity)
    return sorted(set(experts_families()) | set(found))


def is_experts_class(c) -> bool:
    f = getattr(c, "forward", None)
    co = getattr(f, "__code__", None)
    return inspect.isclass(c) and co is not None and co.co_filename.replace("\\", "/").endswith("integrations/moe.py")


def _model_candidates(mod):
    from transformers import PreTrainedModel

    cl = [c for n, c in vars(mod).items() if inspect.isclass(c) and issubclass(c, PreTrainedModel)
          and c.__module__ == mod.__name__ and not n.endswith("PreTrainedModel")]

    def rank(c):
        n = c.__name__
        text_cfg = not getattr(c.config_class, "sub_configs", None)
        for i, suf in enumerate(("ForCausalLM", "TextModel", "Model")):
            if n.endswith(suf):
                return (0 if text_cfg else 1, i, n)
        return (2, 9, n)

    return sorted(cl, key=rank)


def _config_fields(cls) -> set[str]:
    names = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    names |= set(getattr(cls, "attribute_map", {}) or {})
    try:
        names |= set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        pass
    return names


def tiny_config(config_cls, family: str, extra: dict | None = None):
    base = config_cls()
    fields = _config_fields(config_cls) | set(vars(base))
    kw = {}
    for k, v in TINY.items():
        if k in fields or hasattr(base, k):
            kw[k] = v
    if any(k in fields for k in MLA_KEYS):
        kw["head_dim"] = kw.get("qk_rope_head_dim", 16)
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    if "n_shared_experts" in fields and getattr(base, "n_shared_experts", 1) is None:
        kw["n_shared_experts"] = 1
    kw.update(FAMILY_OVERRIDES.get(family, {}))
    if extra:
        kw.update(extra)
    kw = {k: v for k, v in kw.items() if k in fields or hasattr(base, k)}
    return config_cls(**kw)


def _retry_fixes(msg: str) -> dict | None:
    if "num_key_value_heads" in msg and "same" in msg:
        return {"num_key_value_heads": TINY["num_attention_heads"]}
    if "num_experts_per_tok=1" in msg:
        return {"num_experts_per_tok": 1}
    return None


def _randomize_biases(model: nn.Module, seed: int) -> None:
    """Zero-initialised tensors (routing biases, some routers) would hide their handling: give them random values.
    An all-zero 2-D integer buffer [V, k] beside a router weight [E, H] (a hash-routing table, DeepSeek-V4's
    ``tid2eid``: real values come from the checkpoint) gets k distinct random experts per row."""
    g = torch.Generator().manual_seed(seed + 17)
    names = ("e_score_correction_bias", "expert_bias", "correction_bias")
    with torch.no_grad():
        for m in model.modules():
            w = getattr(m, "weight", None)
            for t in m.buffers(recurse=False):
                if (isinstance(w, torch.Tensor) and w.dim() == 2 and t.dim() == 2 and not t.is_floating_point()
                        and 0 < t.shape[1] <= w.shape[0] and t.shape[0] > t.shape[1] and not t.any()):
                    t.copy_(torch.stack([torch.randperm(w.shape[0], generator=g)[: t.shape[1]]
                                         for _ in range(t.shape[0])]))
        for p in model.parameters():
            if p.is_floating_point() and p.numel() > 1 and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        for mname, m in model.named_modules():
            for n, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                if t is not None and t.is_floating_point() and any(k in n for k in names):
                    t.copy_(torch.randn(t.shape, generator=g) * 0.3)
            if isinstance(getattr(m, "bias", None), torch.Tensor) and ("router" in mname or mname.endswith("gate")):
                b = m.bias
                if b.dim() == 1 and b.is_floating_point():
                    b.copy_(torch.randn(b.shape, generator=g) * 0.5)


def build_tiny(family: str, seed: int = 0, sizes: dict | None = None):
    """(model, model class name) for ``family`` (or a variant, ``VARIANTS``); raises with the reason when it cannot
    be built tiny. ``sizes``: config fields over ``TINY`` (e.g. ``hidden_size``), for tests that need other shapes."""
    if family in VARIANTS:
        family, changes = VARIANTS[family]
        sizes = {**changes, **(sizes or {})}
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    experts = tuple(c for c in vars(mod).values() if is_experts_class(c))
    errors = []
    for mc in _model_candidates(mod):
        extra = dict(sizes or {})
        for _attempt in range(3):
            try:
                cfg = tiny_config(mc.config_class, family, extra)
                with torch.device("meta"):  # size check first: a config field we do not shrink can be huge
                    n = sum(p.numel() for p in mc(cfg).parameters())
                if n > MAX_PARAMS:
                    raise RuntimeError(f"tiny config still has {n / 1e6:.0f}M parameters (a size field we do not "
                                       f"shrink)")
                torch.manual_seed(seed)
                model = mc(cfg).eval()
            except Exception as e:  # config validation and build errors
                fix = _retry_fixes(str(e))
                if fix and not all(extra.get(k) == v for k, v in fix.items()):
                    extra.update(fix)
                    continue
                errors.append(f"{mc.__name__}: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
                break
            if not any(isinstance(m, experts) for m in model.modules()) and not discover.routed_blocks(
                    model, _hidden_of(cfg)):
                errors.append(f"{mc.__name__}: tiny model has no experts module")
                break
            _randomize_biases(model, seed)
            return model, mc.__name__
        if errors and not errors[-1].endswith("no experts module"):
            break  # the preferred class failed to build: report that error
    raise RuntimeError("; ".join(errors) or "no model class found")


# ----------------------------------------------------------------------------------------------- counting
class OpCounter(TorchDispatchMode):
    """Counts ``torch.ops.moecomp.moe_forward`` calls while active."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.experts_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.moecomp.moe_forward.default:
            self.calls += 1
        elif func is torch.ops.moecomp.moe_experts.default:
            self.experts_calls += 1
        return func(*args, **(kwargs or {}))


def _count_in(modules: dict, fn, which: str):
    """Run ``fn()`` under an OpCounter; return (result, {name: ``which`` op calls inside that module}, total
    ``which`` calls, {name: times the module's forward ran}). ``which`` is "calls" or "experts_calls"."""
    counter = OpCounter()
    per, runs, start = {}, {}, {}
    handles = []
    for name, m in modules.items():
        per[name] = runs[name] = 0

        def pre(mod, args, _n=name):
            start[_n] = getattr(counter, which)

        def post(mod, args, out, _n=name):
            per[_n] += getattr(counter, which) - start.pop(_n)
            runs[_n] += 1

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with counter:
            res = fn()
    finally:
        for h in handles:
            h.remove()
    return res, per, getattr(counter, which), runs


def count_calls_per_block(model: nn.Module, fn, with_forwards: bool = False):
    """Run ``fn()``; return (its result, {block name: moe_forward calls inside it}, total calls).

    With ``with_forwards``, also {block name: times the block's forward ran} (a block the input does not reach,
    e.g. the vision experts of a text-only input, runs 0 times and calls the op 0 times).
    """
    from ..api.optimize import rewritten_blocks

    res, per, total, runs = _count_in(rewritten_blocks(model), fn, "calls")
    return (res, per, total, runs) if with_forwards else (res, per, total)


def count_experts_calls(model: nn.Module, fn):
    """Run ``fn()``; return (its result, {experts module: moe_experts calls inside it}, total moe_experts calls,
    {experts module: times it ran}) for the experts modules of experts-only rewrites."""
    from ..api.optimize import experts_only_modules

    return _count_in(experts_only_modules(model), fn, "experts_calls")


# ----------------------------------------------------------------------------------------------- checking
@dataclass
class FamilyResult:
    family: str
    status: str  # equal | experts only | not equal | not rewritten | partial | no MoE block | build failed | ...
    model_class: str = ""
    blocks: int = 0
    rewritten: int = 0
    experts_only: int = 0  # blocks whose experts module alone runs moe_experts
    calls_ok: bool = False
    max_rel_err: float | None = None
    router: str = ""
    experts: str = ""
    reason: str = ""
    seconds: float = 0.0
    skipped: list = field(default_factory=list)
    fallback: str = ""  # what the attribute fallback alone does (optimize(use_capture=False)): equal / skipped ...
    fallback_agrees: str = "-"  # where the FX pass detected the blocks: does the fallback give the same spec

    def to_dict(self):
        return dataclasses.asdict(self)


def _logits(out):
    for k in ("logits", "last_hidden_state"):
        v = getattr(out, k, None)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def check_family(family: str, seed: int = 0, batch: int = 2, seq: int = 5, use_capture: bool = True,
                 fallback_too: bool = False) -> FamilyResult:
    """Build ``family`` tiny, optimize, compare. ``fallback_too``: also run the attribute fallback alone."""
    r = _check_family(family, seed, batch, seq, use_capture)
    if fallback_too and use_capture and r.status not in ("build failed", "import failed"):
        f = _check_family(family, seed, batch, seq, use_capture=False)
        r.fallback = f.status + (f": {f.reason}" if f.reason and f.status != "equal" else "")
        r.seconds += f.seconds
    return r


def _check_family(family: str, seed: int, batch: int, seq: int, use_capture: bool) -> FamilyResult:
    t0 = time.perf_counter()
    r = FamilyResult(family, "build failed")
    try:
        ran = _build_and_run(r, family, seed, batch, seq)
        if ran is None:
            return r
        model, kwargs, ref = ran
        rep = _optimize_for_table(r, model, use_capture)
        if rep is None:
            return r
        _read_report(r, rep, model)
        if r.blocks:
            _compare(r, rep, model, kwargs, ref)
        return r
    finally:
        r.seconds = time.perf_counter() - t0


def _build_and_run(r: FamilyResult, family: str, seed: int, batch: int, seq: int):
    """(model, forward kwargs, reference logits) of the family built tiny, or None with ``r``'s status set."""
    try:
        model, r.model_class = build_tiny(family, seed)
    except ImportError as e:
        r.status, r.reason = "import failed", f"{type(e).__name__}: {e}"
        return None
    except Exception as e:
        r.reason = str(e)[:400]
        return None
    g = torch.Generator().manual_seed(seed)
    vocab = getattr(model.config, "vocab_size", None) or getattr(getattr(model.config, "text_config", None),
                                                                 "vocab_size", 128)
    ids = torch.randint(3, min(int(vocab), 128), (batch, seq), generator=g)
    kwargs = {"input_ids": ids}
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        kwargs["use_cache"] = False
    if "decoder_input_ids" in params:  # encoder-decoder models: the same tokens into the decoder
        kwargs["decoder_input_ids"] = ids
    probe = discover.RoutingProbe()
    try:
        with torch.no_grad(), probe:
            ref = _logits(model(**kwargs)).clone()
    except Exception as e:
        r.status, r.reason = "build failed", f"forward: {type(e).__name__}: {str(e)[:300]}"
        return None
    if base_family(family) not in experts_families():  # found by structure: a router must feed a top-k at run time
        widths = discover.routed_blocks(model, _hidden_of(model.config))
        if not set(widths.values()) & probe.widths:
            r.status = "not routed"
            r.reason = (f"structure only: router widths {sorted(set(widths.values()))} of {sorted(widths)[:3]} feed "
                        f"no top-k / argmax at run time (widths seen: {sorted(probe.widths)[:8]})")
            return None
    return model, kwargs, ref


def _optimize_for_table(r: FamilyResult, model, use_capture: bool):
    """``optimize``'s report of the model (the attribute reader compared with the FX pass), or None with ``r``'s
    status set when optimize raised."""
    from ..api.optimize import optimize
    from ..recognise import recognise as _recognise  # noqa: PLC0415

    compare, _recognise.COMPARE_FALLBACK = _recognise.COMPARE_FALLBACK, True  # the table's "fallback agrees" column
    try:
        _, rep = optimize(model, report=True, use_capture=use_capture)
    except Exception as e:
        r.status = "not rewritten"
        r.reason = f"optimize raised {type(e).__name__}: {e}\n{traceback.format_exc()[-600:]}"
        return None
    finally:
        _recognise.COMPARE_FALLBACK = compare
    return rep


def _read_report(r: FamilyResult, rep, model) -> None:
    """The table's columns from optimize's report; a model without candidate blocks gets its status here."""
    r.blocks = len(rep.blocks)
    r.rewritten = len(rep.rewritten)
    r.experts_only = len(rep.experts_only)
    r.skipped = [f"{b.name}: {b.reason}" for b in rep.blocks if b.status == BlockStatus.SKIPPED]
    fx = [b for b in rep.rewritten if b.method == "fx"]
    if fx:
        r.fallback_agrees = "yes" if all("attribute fallback agrees" in b.notes for b in fx) else "no: " + "; ".join(
            n for b in fx for n in b.notes if n.startswith("attribute fallback"))[:200]
    styles = {b.router for b in rep.rewritten if b.router}
    r.router = "; ".join(sorted(styles))
    r.experts = "; ".join(sorted({b.experts for b in rep.rewritten if b.experts} | {
        b.experts.split(" (")[0] + " (experts only)" for b in rep.experts_only if b.experts}))
    if r.blocks == 0:
        by_structure = sorted(discover.routed_blocks(model, _hidden_of(model.config)))
        r.status, r.reason = "no MoE block", "no candidate block found" + (
            f" (the block finder, recognise/structure.py, reads part names; by structure, recognise/discover.py: "
            f"{', '.join(by_structure[:3])}{' ...' if len(by_structure) > 3 else ''})" if by_structure else "")


def _compare(r: FamilyResult, rep, model, kwargs: dict, ref: torch.Tensor) -> None:
    """The optimized model's logits against ``ref``, and its op calls counted: ``r``'s status and reason."""
    try:
        def fwd():
            with torch.no_grad():
                return _logits(model(**kwargs))

        (out, per, total, runs), eper, etotal, eruns = count_experts_calls(
            model, lambda: count_calls_per_block(model, fwd, with_forwards=True))
    except Exception as e:
        r.status, r.reason = "not equal", f"optimized forward raised {type(e).__name__}: {str(e)[:300]}"
        return
    # exactly one op call per block call (a block the input does not reach runs 0 times), and none elsewhere
    calls_fwd = (len(per) == r.rewritten and all(per[n] == runs[n] for n in per)
                 and (any(runs.values()) or r.rewritten == 0) and total == sum(per.values()))
    calls_exp = (len(eper) == r.experts_only and all(eper[n] == eruns[n] for n in eper)
                 and (any(eruns.values()) or r.experts_only == 0) and etotal == sum(eper.values()))
    r.calls_ok = calls_fwd and calls_exp
    err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    r.max_rel_err = err
    if r.rewritten == 0 and r.experts_only == 0:
        r.status = "not rewritten"
        r.reason = "; ".join(sorted({b.reason for b in rep.blocks}))
    elif not (err <= TOL) or not torch.isfinite(out).all():
        r.status, r.reason = "not equal", f"logits max rel. err {err:.2e}"
    elif not calls_fwd:
        r.status, r.reason = "not equal", f"moe_forward calls per block {per} for block runs {runs}, total {total}"
    elif not calls_exp:
        r.status, r.reason = "not equal", (f"moe_experts calls per experts module {eper} for module runs {eruns}, "
                                           f"total {etotal}")
    elif r.rewritten + r.experts_only < r.blocks:
        r.status = "partial"
        r.reason = "; ".join(sorted({b.reason for b in rep.skipped}))
    elif r.experts_only:
        r.status = "experts only"
        r.reason = "; ".join(sorted({b.reason for b in rep.experts_only}))
    else:
        r.status = "equal"


def run_coverage(families: list[str] | None = None, progress=None, fallback_too: bool = True) -> list[FamilyResult]:
    out = []
    families = families or moe_families()
    for fam in sorted(set(families) | set(variants_of(families))):
        res = check_family(fam, fallback_too=fallback_too)
        out.append(res)
        if progress:
            progress(res)
    return out
