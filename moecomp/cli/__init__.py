"""Command line: ``python -m moecomp {demo, scan, coverage, tune}`` (also the ``moecomp`` script).

    python -m moecomp demo                       # random-weight Qwen3-MoE, optimized, checked, timed
    python -m moecomp scan PATH [--json]         # MoE blocks of a local model folder / config.json (meta device)
    python -m moecomp coverage [--out FILE]      # regenerate docs/coverage.md (all transformers MoE families)
    python -m moecomp tune [--presets ...] [--shape E,I,H,k ...] [--tokens 1,16,...] [--restart] [--budget-s S]
                                                 # tune the kernel configs on this GPU (moecomp/kernels/configs/)

``demo`` and ``tune`` parse their own options (``python -m moecomp tune --help``); they live beside this module
(``demo.py``, ``tune.py`` with ``tune_fp8.py`` / ``tune_io.py``). The top layer: the commands run the API and the
tools below (testing, coverage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _load_config(path: str):
    from transformers import AutoConfig

    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        mt = d.pop("model_type", None)
        if mt is None:
            raise SystemExit(f"{path}: no model_type in the config")
        return AutoConfig.for_model(mt, **d)
    raise SystemExit(f"{path}: not a folder or a config.json file")


def build_meta(path: str):
    """The model of a local folder / config.json on the meta device (no weights), in the config's dtype."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = _load_config(path)
    dtype = cfg.dtype if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    errors = []
    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                kw = {"dtype": dtype} if isinstance(dtype, torch.dtype) else {}
                try:
                    return auto.from_config(cfg, **kw)
                except TypeError:
                    return auto.from_config(cfg)
        except Exception as e:  # unknown architecture for this auto class
            errors.append(f"{auto.__name__}: {type(e).__name__}: {e}")
    raise SystemExit("cannot build the model: " + " | ".join(errors))


def cmd_scan(a) -> int:
    from ..api.optimize import scan

    model = build_meta(a.path)
    rep = scan(model)
    if a.json:
        print(rep.to_json())
    else:
        print(rep)
        print("meta device: no weights, so the FX pass cannot run the block; routing and activations were read from "
              "attributes and source by the attribute fallback and are not verified (status 'unverified').")
    return 0


def cmd_coverage(a) -> int:
    import torch

    from ..coverage import markdown as coverage_md

    fams = a.families or None
    torch.set_num_threads(1)  # tiny models: extra intra-op threads only add latency

    def progress(r):
        eo = f"+{r.experts_only}e" if r.experts_only else ""
        print(f"{r.family:24s} {r.status:14s} {r.rewritten}/{r.blocks}{eo} {r.seconds:5.1f}s {r.reason[:100]}",
              flush=True)

    results = coverage_md.write_coverage(a.out, fams, progress)
    bad = [r for r in results if r.status == "not equal"]
    print(f"wrote {a.out}: {len(results)} families")
    return 1 if bad else 0


def cmd_demo(a) -> int:
    from . import demo

    return demo.main(a.rest)


def cmd_tune(a) -> int:
    from . import tune  # imports Triton's launch wrappers only when it runs: ``import moecomp`` stays light

    return tune.main(a.rest)


# commands that parse their own options: everything after the name goes to them as it is (argparse's REMAINDER
# would not take a leading ``--option``)
_FORWARDED = {"demo": cmd_demo, "tune": cmd_tune}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _FORWARDED:
        return _FORWARDED[argv[0]](argparse.Namespace(rest=argv[1:]))
    p = argparse.ArgumentParser(prog="python -m moecomp", description="moecomp: fast MoE layers for HF models")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("scan", help="list the MoE blocks of a local model folder or config.json (no weights)")
    s.add_argument("path")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_scan)
    c = sub.add_parser("coverage", help="regenerate docs/coverage.md")
    c.add_argument("--out", default=os.path.join("docs", "coverage.md"))
    c.add_argument("families", nargs="*", help="only these families (default: all)")
    c.set_defaults(fn=cmd_coverage)
    d = sub.add_parser("demo", help="optimize a random-weight Qwen3-MoE, check it, time it", add_help=False)
    d.add_argument("rest", nargs=argparse.REMAINDER)
    d.set_defaults(fn=cmd_demo)
    t = sub.add_parser("tune", help="tune the fused-MoE kernel configs on this GPU (resumable; --help for options)",
                       add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(fn=cmd_tune)
    a = p.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
