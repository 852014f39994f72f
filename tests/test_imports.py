"""``import moecomp`` is cheap and side-effect free; moecomp's modules import each other without cycles, in layers.

* A fresh ``import moecomp`` imports neither transformers nor ``torch._dynamo`` nor Triton, and still registers
  ``torch.ops.moecomp.*``; the public names are there.
* transformers' experts interface gets ``"moecomp"`` when its MoE integration is imported (before or after
  moecomp), and its ``"eager"`` entry stays transformers' own.
* The ``"moecomp"`` torch.compile backend is found by name (entry point, or importing ``moecomp.api.backend``), in any
  order of imports.
* The import graph of moecomp's modules (read from the source: top-level imports, plus the imports inside
  functions listed apart) has no cycle; every package under moecomp/ is one layer of one ordered list (``LAYERS``,
  bottom to top, the picture at the top of docs/ARCHITECTURE.md) and no module imports one of a higher layer; no
  module imports another's private name; the FX pass and the HF integration never reach the kernels.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "moecomp"


def run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter (cwd: the repository root); its stdout. Fails the test on an error."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"fresh interpreter failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


needs_transformers = pytest.mark.skipif(not _has_transformers(), reason="transformers not installed")


# ------------------------------------------------------------------------------------------------ import moecomp
def test_import_is_light():
    out = run_fresh("""
        import sys
        import moecomp
        heavy = [m for m in ("transformers", "torch._dynamo", "torch._inductor", "triton", "moecomp.api.backend",
                             "moecomp.recognise.capture", "moecomp.recognise.fx", "moecomp.kernels") if m in sys.modules]
        print("heavy", heavy)
        import torch
        for op in ("moe_forward", "moe_experts", "decode_attention"):
            assert hasattr(torch.ops.moecomp, op), op
        for name in ("optimize", "unoptimize", "scan", "Report", "MoESpec", "SharedExpertSpec", "SpecError"):
            assert callable(getattr(moecomp, name)), name
        moecomp.core.counters.clear()
        print("ok")
    """)
    assert "heavy []" in out, out
    assert out.strip().endswith("ok")


def test_lazy_submodules():
    out = run_fresh("""
        import sys
        import moecomp
        assert "moecomp.api.backend" not in sys.modules
        assert moecomp.backend.BACKEND_NAME == "moecomp"     # imported on first access
        assert "moecomp.api.backend" in sys.modules
        assert moecomp.capture.detect_block is not None
        import moecomp.api.optimize                          # the submodule does not shadow the function
        assert callable(moecomp.optimize) and moecomp.optimize.__name__ == "optimize"
        try:
            moecomp.no_such_name
        except AttributeError:
            print("ok")
    """)
    assert out.strip().endswith("ok")


# ------------------------------------------------------------------------------- transformers' experts interface
@needs_transformers
@pytest.mark.parametrize("order", ["moecomp first", "transformers first"])
def test_experts_registration(order):
    first, second = ("import moecomp", "import transformers.integrations.moe") if order == "moecomp first" else \
        ("import transformers.integrations.moe", "import moecomp")
    out = run_fresh(f"""
        import sys
        {first}
        {second}
        import transformers
        from transformers.integrations import moe as hf_moe
        from moecomp.hf import experts_interface as ei
        fns = hf_moe.ALL_EXPERTS_FUNCTIONS
        assert ei.REGISTERED and ei.ensure_registered()
        assert "moecomp" in fns and fns["moecomp"] is ei.moecomp_experts_forward
        # transformers' own "eager" (the class's forward) is untouched: not in either mapping
        assert "eager" not in fns._local_mapping and "eager" not in type(fns)._global_mapping
        sentinel = object()
        assert fns.get_interface("eager", sentinel) is sentinel
        assert ei._finder not in sys.meta_path   # the import hook removed itself
        print("ok")
    """)
    assert out.strip().endswith("ok")


@needs_transformers
@pytest.mark.parametrize("order", ["moecomp first", "transformers first"])
def test_fp8_experts_registration(order):
    """"moecomp" lands in transformers' FP8ExpertsInterface too (FP8Experts dispatch there), lazily."""
    first, second = ("import moecomp", "import transformers.integrations.finegrained_fp8") if order == \
        "moecomp first" else ("import transformers.integrations.finegrained_fp8", "import moecomp")
    out = run_fresh(f"""
        import sys
        {first}
        {second}
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
        from moecomp.hf import experts_interface as ei
        assert ei.FP8_REGISTERED and ALL_FP8_EXPERTS_FUNCTIONS["moecomp"] is ei.moecomp_experts_forward
        assert ei._fp8_finder not in sys.meta_path and ei._finder not in sys.meta_path
        assert "eager" not in ALL_FP8_EXPERTS_FUNCTIONS._local_mapping   # (the compile backend is not imported)
        print("ok")
    """)
    assert out.strip().endswith("ok")


@needs_transformers
def test_experts_implementation_moecomp_from_config():
    """A model built with ``experts_implementation="moecomp"`` after a plain ``import moecomp`` finds the name."""
    out = run_fresh("""
        import moecomp, torch
        from transformers import AutoModelForCausalLM, Qwen3MoeConfig
        cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                             num_experts_per_tok=2, head_dim=16)
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moecomp").eval()
        assert model.config._experts_implementation == "moecomp"
        with torch.no_grad():
            model(torch.randint(0, 64, (1, 5)))
        print("ok")
    """)
    assert out.strip().endswith("ok")


@needs_transformers
def test_optimize_leaves_transformers_eager_entry_alone():
    """``optimize``'s FX path traces "eager" experts as grouped_mm while it captures, then gives the entry back."""
    out = run_fresh("""
        import moecomp, torch
        from transformers import AutoModelForCausalLM, Qwen3MoeConfig
        from transformers.integrations import moe as hf_moe
        cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                             num_experts_per_tok=2, head_dim=16)
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
        _, rep = moecomp.optimize(model, report=True)
        assert len(rep.rewritten) == 1, rep
        assert "eager" not in hf_moe.ALL_EXPERTS_FUNCTIONS._local_mapping
        print("ok")
    """)
    assert out.strip().endswith("ok")


# ----------------------------------------------------------------------------------------- torch.compile backend
def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return "moecomp" in entry_points(group="torch_dynamo_backends").names


@pytest.mark.parametrize("order", ["entry point", "import backend first", "discover, then import backend"])
def test_backend_lookup(order):
    if order != "import backend first" and not _entry_point_installed():
        pytest.skip("the torch_dynamo_backends entry point is not installed (pip install -e .)")
    pre = {
        "entry point": "",
        "import backend first": "import moecomp.api.backend",
        "discover, then import backend": "torch._dynamo.list_backends(); import moecomp.api.backend",
    }[order]
    out = run_fresh(f"""
        import sys, torch, moecomp
        assert "torch._dynamo" not in sys.modules
        import torch._dynamo
        {pre}
        from torch._dynamo.backends.registry import lookup_backend
        fn = lookup_backend("moecomp")
        from moecomp.api.backend import moecomp_backend
        assert fn is moecomp_backend, fn
        assert lookup_backend("moecomp") is moecomp_backend
        assert "moecomp" in torch._dynamo.list_backends(exclude_tags=())
        print("ok")
    """)
    assert out.strip().endswith("ok")


HIDE_ENTRY_POINT = """
    import importlib.metadata as md
    _real = md.entry_points
    def _entry_points(**kw):  # as from a source tree on PYTHONPATH: no torch_dynamo_backends entry for moecomp
        eps = _real(**kw)
        if kw.get("group") == "torch_dynamo_backends":
            return md.EntryPoints([e for e in eps if e.name != "moecomp"])
        return eps
    md.entry_points = _entry_points
"""


def test_backend_name_unknown_without_entry_point_or_moecomp():
    """The control for the next test: with the entry point hidden and moecomp not imported, torch does not know
    the name (what a source-tree user saw even after ``import moecomp``)."""
    out = run_fresh(HIDE_ENTRY_POINT + """
    import torch, torch._dynamo
    from torch._dynamo.exc import InvalidBackend
    try:
        torch._dynamo.backends.registry.lookup_backend("moecomp")
    except InvalidBackend:
        print("ok")
    """)
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("order", ["moecomp first", "dynamo first"])
def test_backend_name_from_a_source_tree(order):
    """``import moecomp`` makes backend="moecomp" resolve without the installed entry point, still without
    importing Dynamo itself; torch.compile runs with it; the name resolves to moecomp.api.backend.moecomp_backend."""
    first, second = ("import moecomp", "import torch._dynamo") if order == "moecomp first" else (
        "import torch._dynamo", "import moecomp")
    out = run_fresh(HIDE_ENTRY_POINT + f"""
    import sys, torch
    {first}
    if {order == "moecomp first"}:
        assert "torch._dynamo" not in sys.modules
    {second}
    from torch._dynamo.backends.registry import lookup_backend
    from moecomp.api.backend import moecomp_backend
    assert lookup_backend("moecomp") is moecomp_backend
    assert "moecomp" in torch._dynamo.list_backends(exclude_tags=())
    m = torch.compile(torch.nn.Linear(4, 4), backend="moecomp")
    assert m(torch.randn(2, 4)).shape == (2, 4)
    print("ok")
    """)
    assert out.strip().endswith("ok")


# ------------------------------------------------------------------------------------------------- import graph
def _modules() -> dict:
    """moecomp module name -> (path, is_package)."""
    out = {}
    for dp, dn, fn in os.walk(os.path.join(ROOT, PKG)):
        dn[:] = [d for d in dn if d != "__pycache__"]
        for f in fn:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dp, f), ROOT)[:-3].replace(os.sep, ".")
                ispkg = rel.endswith(".__init__")
                out[rel[: -len(".__init__")] if ispkg else rel] = (os.path.join(dp, f), ispkg)
    return out


MODS = _modules()


def _targets(mod: str, ispkg: bool, node) -> list[str]:
    """Absolute names an import statement of ``mod`` imports (``from pkg import sub`` counts ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = mod if ispkg else mod.rpartition(".")[0]
    if node.level:
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        tgt = f"{base}.{node.module}" if node.module else base
    else:
        tgt = node.module or ""
    subs = [f"{tgt}.{a.name}" for a in node.names if f"{tgt}.{a.name}" in MODS]
    # ``from pkg import sub`` imports the submodule (its package runs first anyway); a name of the package counts
    return subs if len(subs) == len(node.names) else [tgt] + subs


def _imports() -> tuple[dict, dict]:
    """({module: {(imported moecomp module, line)}} at top level (module body, ``if`` / ``try`` blocks included:
    a ``TYPE_CHECKING`` import counts), the same for imports inside functions (lazy))."""
    top, lazy = {}, {}
    for mod, (path, ispkg) in MODS.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        t, lz = set(), set()

        def visit(node, in_func):
            for ch in ast.iter_child_nodes(node):
                if isinstance(ch, (ast.Import, ast.ImportFrom)):
                    for name in _targets(mod, ispkg, ch):
                        if name.split(".")[0] == PKG:
                            (lz if in_func else t).add((name, ch.lineno))
                visit(ch, in_func or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
        top[mod], lazy[mod] = t, lz
    return top, lazy


TOP, LAZY = _imports()


def _graph(include_lazy: bool) -> dict:
    """module -> modules its imports run: the imported module and its packages, less the importer's own
    packages (already being imported when it runs)."""
    g = {m: set() for m in MODS}
    for m in MODS:
        for name, _ in TOP[m] | (LAZY[m] if include_lazy else set()):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                t = ".".join(parts[:i])
                if t in MODS and t != m and not m.startswith(t + "."):
                    g[m].add(t)
    return g


def _cycles(g: dict) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


# Imports inside functions that close a cycle, allowed for now (each one a known debt, not a pattern to copy): none.
# (bind.bind <-> hf.experts_interface was one, until the attribute snapshots moved below both, to core/snapshot.py.)
KNOWN_LAZY_CYCLES: list = []

# Imports inside functions on purpose: they keep Triton and the kernels out of ``import moecomp`` (no cycle).
LAZY_BY_DESIGN = {
    ("moecomp.ops.moe_op", "moecomp.ops.triton_moe"),
    ("moecomp.ops.attention", "moecomp.ops.triton_attention"),
}


def test_no_import_cycles_top_level():
    assert _cycles(_graph(include_lazy=False)) == []


def test_no_import_cycles_with_lazy_imports():
    """Imports inside functions hide a cycle without removing it: only the listed ones are tolerated."""
    found = _cycles(_graph(include_lazy=True))
    assert [c for c in found if c not in KNOWN_LAZY_CYCLES] == [], found


def test_lazy_imports_listed():
    """Every import inside a function, for review; the Triton paths stay lazy (``import moecomp`` stays light)."""
    lazy = {(m, n) for m in LAZY for n, _ in LAZY[m]}
    assert LAZY_BY_DESIGN <= lazy, LAZY_BY_DESIGN - lazy
    top = {(m, n) for m in TOP for n, _ in TOP[m]}
    assert not LAZY_BY_DESIGN & top, LAZY_BY_DESIGN & top
    print("\n".join(f"lazy: {m} -> {n} (line {ln})" for m in sorted(LAZY) for n, ln in sorted(LAZY[m])))


def _under(name: str, *pkgs: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in pkgs)


def test_fx_pass_and_hf_never_import_kernels():
    bad = []
    for m in MODS:
        if _under(m, "moecomp.recognise.fx", "moecomp.hf"):
            bad += [(m, n, ln) for n, ln in TOP[m] | LAZY[m] if _under(n, "moecomp.kernels")]
    assert bad == [], bad
    # nor through the modules they import at top level
    g = _graph(include_lazy=False)
    for m in MODS:
        if not _under(m, "moecomp.recognise.fx", "moecomp.hf"):
            continue
        seen, todo = set(), [m]
        while todo:
            v = todo.pop()
            for w in g[v] - seen:
                seen.add(w)
                todo.append(w)
        assert not [w for w in seen if _under(w, "moecomp.kernels")], (m, sorted(seen))


# The layers, bottom to top (docs/ARCHITECTURE.md draws the same list): a module imports modules of its own layer or
# of layers below it, never above (imports inside functions included). ``moecomp`` itself (``__init__``,
# ``__main__``: the public names, ``python -m moecomp``) is the top.
LAYERS = ("moecomp.core", "moecomp.kernels", "moecomp.ops", "moecomp.parallel", "moecomp.oracle", "moecomp.formats",
          "moecomp.probe", "moecomp.hf", "moecomp.bind", "moecomp.verify", "moecomp.recognise", "moecomp.generate",
          "moecomp.api", "moecomp.testing", "moecomp.coverage", "moecomp.cli", PKG)


def _layer(mod: str) -> int:
    for i, layer in enumerate(LAYERS[:-1]):
        if _under(mod, layer):
            return i
    return len(LAYERS) - 1


def test_every_package_is_a_layer():
    """Every package under moecomp/ is one of the layers, and only ``__init__`` / ``__main__`` sit at the top."""
    top = [m for m in MODS if _layer(m) == len(LAYERS) - 1]
    assert sorted(top) == [PKG, f"{PKG}.__main__"], top
    pkgs = sorted(d for d in os.listdir(os.path.join(ROOT, PKG))
                  if os.path.isfile(os.path.join(ROOT, PKG, d, "__init__.py")))
    assert pkgs == sorted(layer.rpartition(".")[2] for layer in LAYERS[:-1]), pkgs


def test_layers_import_only_downwards():
    """No module imports one of a higher layer: top-level imports and imports inside functions alike."""
    bad = [(m, n, ln) for m in sorted(MODS) for n, ln in sorted(TOP[m] | LAZY[m]) if _layer(n) > _layer(m)]
    assert bad == [], "\n".join(f"{m} ({LAYERS[_layer(m)]}) imports {n} ({LAYERS[_layer(n)]}), line {ln}"
                                 for m, n, ln in bad)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_names_imported():
    """No module imports another module's private name (``from x import _name``) nor a private module: what two
    modules share is a public name where it is defined (a private alias on the importing side is fine)."""
    bad = []
    for mod, (path, ispkg) in MODS.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                tgt = node.module or ""
                if node.level:
                    base = mod if ispkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    tgt = f"{base}.{node.module}" if node.module else base
                if tgt.split(".")[0] != PKG or tgt == mod:
                    continue
                bad += [(mod, f"{tgt}.{a.name}", node.lineno) for a in node.names if _private(a.name)]
                bad += [(mod, tgt, node.lineno) for part in tgt.split(".") if _private(part)]
            elif isinstance(node, ast.Import):
                bad += [(mod, a.name, node.lineno) for a in node.names
                        if a.name.split(".")[0] == PKG and any(_private(p) for p in a.name.split("."))]
    assert bad == [], bad


def test_architecture_picture_is_the_layer_list():
    """docs/ARCHITECTURE.md opens with the layers, top to bottom, one row per package: the same list, in the same
    order, as ``LAYERS`` (and so as ``ls moecomp``)."""
    with open(os.path.join(ROOT, "docs", "ARCHITECTURE.md"), encoding="utf-8") as f:
        text = f.read()
    picture = text[:text.index("\n\n", text.index("    +---"))]
    rows = [m.group(1) for m in re.finditer(r"^    \| (\w+)/ +\|", picture, flags=re.M)]
    assert rows == [layer.rpartition(".")[2] for layer in reversed(LAYERS[:-1])], rows
