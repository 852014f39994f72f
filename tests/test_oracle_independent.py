"""The oracle shares no code with the op (issue 40): nothing under moecomp/ops, moecomp/parallel or moecomp/kernels
imports ``moecomp.oracle`` (``reference.py``, ``reference_steps.py`` and every other module split from them), at
top level or inside a function, and the oracle imports nothing of the op (``moecomp.ops``, ``moecomp.parallel``,
``moecomp.kernels``). A bug in shared routing, activation or shared-expert code would otherwise pass every
op-against-oracle test unseen.

Read from the source (the AST of every module), so a lazy import inside a function counts as much as a top-level
one. Also: both implementations of the op satisfy the one declared interface (``ops/backend.Backend``) and return
its one result type.
"""

from __future__ import annotations

import ast
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG_DIR = os.path.join(ROOT, "moecomp", "oracle")
# the oracle: reference.py and the modules split from it (reference_steps.py, ...), every module of moecomp/oracle/
ORACLE = tuple(sorted(f"moecomp.oracle.{f[:-3]}" for f in os.listdir(PKG_DIR)
                     if f.endswith(".py") and f != "__init__.py"))
OP_SIDE = ("moecomp.ops", "moecomp.parallel", "moecomp.kernels")


def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _modules_under(*pkgs: str) -> list[str]:
    """Paths of every .py file of the given packages (dotted names under moecomp)."""
    out = []
    for pkg in pkgs:
        top = os.path.join(ROOT, *pkg.split("."))
        for d, _, files in os.walk(top):
            out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def imported_names(path: str, root: str = ROOT) -> set[tuple[str, int]]:
    """(absolute dotted name, line) of everything the module at ``path`` imports, anywhere in it: ``import a.b``,
    ``from a import b`` (both ``a`` and ``a.b``: b may be a submodule), relative imports resolved."""
    mod = _module_name(path, root)
    is_pkg = path.endswith("__init__.py")
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = base[: len(base) - (node.level - 1)]
                src = ".".join(parent + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            out.add((src, node.lineno))
            out |= {(f"{src}.{a.name}", node.lineno) for a in node.names if a.name != "*"}
    return out


def _hits(name: str, targets) -> bool:
    return any(name == t or name.startswith(t + ".") for t in targets)


def test_the_reader_sees_every_import_form(tmp_path):
    """The checker itself: each way of importing the oracle is found (a checker that found nothing would pass)."""
    src = ("from ..oracle import reference\n"
           "from ..oracle.reference import route\n"
           "from moecomp.oracle.reference_steps import rms_norm\n"
           "import moecomp.oracle.reference as r\n"
           "def f():\n    from moecomp.oracle import reference_steps\n")
    d = tmp_path / "moecomp" / "ops"
    d.mkdir(parents=True)
    p = d / "probe.py"
    p.write_text(src)
    lines = sorted(ln for n, ln in imported_names(str(p), str(tmp_path)) if _hits(n, ORACLE))
    assert sorted(set(lines)) == [1, 2, 3, 4, 6]


def test_ops_parallel_kernels_never_import_the_oracle():
    paths = _modules_under(*OP_SIDE)
    assert len(paths) > 40  # the packages were found (ops alone has more than 40 modules)
    bad = [(os.path.relpath(p, ROOT), n, ln) for p in paths for n, ln in sorted(imported_names(p)) if _hits(n, ORACLE)]
    assert bad == [], bad


def test_the_oracle_never_imports_the_op():
    assert {"moecomp.oracle.reference", "moecomp.oracle.reference_steps"} <= set(ORACLE), ORACLE
    paths = [os.path.join(PKG_DIR, f"{m.split('.')[-1]}.py") for m in ORACLE]
    bad = [(os.path.relpath(p, ROOT), n, ln) for p in paths for n, ln in sorted(imported_names(p))
           if _hits(n, OP_SIDE)]
    assert bad == [], bad


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_both_implementations_declare_the_one_interface(backend, monkeypatch):
    """torch_moe and triton_moe are ``Backend``s, and their routing returns ``Routed`` with the one field order:
    the oracle's ids (as sets per token) and weights on the same input (the Triton path under the interpreter;
    weights within 1e-6 relative: fp32 sigmoid and renormalisation, summed in another order)."""
    from moecomp.oracle import reference
    from moecomp.ops import backend as b
    from moecomp.core.args import MOE_ARGS
    from moecomp.ops.moe_op import implementation
    from moecomp.core.spec import MoESpec
    from moecomp.testing import random_moe_args

    monkeypatch.setenv("MOECOMP_CPU_BACKEND", backend)
    impl = implementation(torch.device("cpu"))
    assert impl.__name__.endswith(f"{backend}_moe") and isinstance(impl, b.Backend)
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, scoring="sigmoid")
    args = random_moe_args(spec, 6, torch.float32, seed=3)
    x, named = args[0], dict(zip(MOE_ARGS, args[1:]))
    r = impl.route_all(x, named, spec, x.shape)
    assert isinstance(r, b.Routed) and r._fields == ("ids", "weights", "gammas", "gate")
    assert r.ids.shape == (6, 2) and r.weights.dtype == torch.float32 and r.gammas is None
    w, ids = reference.route(torch.nn.functional.linear(x, named["router_w"]), None, spec)
    order = r.ids.long().argsort(1)
    assert torch.equal(r.ids.long().sort(1).values, ids.sort(1).values)
    torch.testing.assert_close(r.weights.gather(1, order), w.gather(1, ids.argsort(1)), rtol=1e-6, atol=0)
