"""``--via-optimize``: ``moecomp.optimize()`` on a holder module around the block, timed on the same inputs as the
other paths, after them (optimize may rewrite the block in place)."""

from __future__ import annotations

import torch

import report  # benchmarks/report.py

from . import common
from .logs import cell_line
from .timing import Path, Timer, run_path


def run_optimize_path(block, saved, timer: Timer, args, device, frec: dict):
    """moecomp.optimize on a holder module around the block, timed on the same inputs (after the others,
    since optimize may rewrite the block in place)."""
    import moecomp

    opt = getattr(moecomp, "optimize", None)
    if opt is None:
        frec["errors"].append("--via-optimize: moecomp.optimize does not exist in this checkout")
        return

    class Holder(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, x):
            return self.mlp(x)

    holder = Holder(block)
    try:
        rep = None
        try:
            new, rep = opt(holder, report=True)
        except TypeError:  # an optimize() without report=
            new = opt(holder)
        holder = new if isinstance(new, torch.nn.Module) else holder
        if rep is not None:
            try:
                frec["optimize_report"] = rep.to_dict()
            except Exception:
                frec["optimize_report"] = str(rep)
            if hasattr(rep, "rewritten") and not rep.rewritten:
                why = ""
                try:
                    why = "; ".join(f"{b.name}: {getattr(b, 'reason', '')}" for b in rep.skipped)
                except Exception:
                    pass
                msg = f"moecomp.optimize rewrote no block ({report._short(why or str(rep), 300)})"
                frec["errors"].append(msg)
                for cell, *_ in saved:
                    cell["paths"]["moecomp_opt"] = dict(error=msg, best_ms=None)
                return
        path = Path("moecomp_opt", holder)
        for cell, x, ref, amb in saved:
            with torch.no_grad():
                cell["paths"]["moecomp_opt"] = run_path(path, x, ref, timer, args, device, args.tol, amb)
            common.log(cell_line(frec["name"] + " (optimize)", cell))
    except common.FatalCudaError:
        raise
    except Exception as e:
        frec["errors"].append(f"moecomp.optimize: {common.root_msg(e)}")
    finally:
        un = getattr(moecomp, "unoptimize", None)
        if callable(un):
            try:
                un(holder)
            except Exception:
                pass
