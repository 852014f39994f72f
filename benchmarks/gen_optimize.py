"""What ``moecomp.optimize`` left, for the generate benchmarks (``bench_generate.py`` re-exports these as ``bg.*``):
a model whose blocks were left unrewritten, or whose ``generate`` was not replaced, is said so plainly, recorded in
the result JSON, and its one-liner rows end with ``NotOptimized`` instead of an AttributeError at
``model.generate.<attr>``."""

from __future__ import annotations


def log(msg: str):
    print(msg, flush=True)


class NotOptimized(RuntimeError):
    """``moecomp.optimize`` did not replace ``model.generate``: the one-liner cannot run (the message says why)."""


def generate_replaced(model) -> bool:
    """Is ``model.generate`` moecomp's (``optimize`` installed it)?"""
    from moecomp.generate.hf_generate import FastGenerate

    return isinstance(model.__dict__.get("generate"), FastGenerate)


def optimize_checked(model, what: str = "", say=None) -> dict:
    """``moecomp.optimize(model)`` and what it left, for the result JSON: {"blocks", "rewritten", "unrewritten":
    [{"name", "reason"}], "generate_replaced"}. Says so plainly on the terminal when blocks holding experts were
    left unrewritten or ``generate`` was not replaced (the one-liner rows then record ``NotOptimized``)."""
    import warnings

    import moecomp
    from moecomp.api.optimize import unrewritten

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (said below, with every block)
        _, rep = moecomp.optimize(model, report=True)
    left = unrewritten(rep)
    st = dict(blocks=len(rep.blocks), rewritten=len(rep.rewritten), experts_only=len(rep.experts_only),
              unrewritten=[dict(name=b.name, reason=b.reason) for b in left], generate_replaced=generate_replaced(model),
              summary=rep.summary())
    say = say or log
    if left or not st["generate_replaced"]:
        say(f"!! {what}moecomp.optimize left {len(left)} of {len(rep.blocks)} MoE block(s) unrewritten; generate "
            f"{'replaced' if st['generate_replaced'] else 'NOT replaced (the one-liner cannot run)'}")
        for b in left[:4]:
            say(f"!!   {b.name}: {b.reason[:400]}")
    return st


def require_generate(model) -> None:
    """``NotOptimized`` (a plain message) unless ``model.generate`` is moecomp's."""
    if not generate_replaced(model):
        st = getattr(model, "_moecomp_report", None)
        left = [] if st is None else [b for b in st.blocks if b.status == "skipped"]
        why = f"; first block left: {left[0].name}: {left[0].reason[:300]}" if left else ""
        raise NotOptimized(f"moecomp.optimize did not replace model.generate ({len(left)} block(s) left "
                           f"unrewritten{why}): no one-liner to time")
