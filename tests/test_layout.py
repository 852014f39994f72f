"""The package layout rules of the brief, checked on the source (AST): passes never import kernels (or Triton),
``moecomp/kernels/`` holds only ``@triton.jit`` functions (plus constants and tuned-config data), and there is no
top-level ``kernels`` / ``passes`` package to clash with HF's ``kernels``."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moecomp"


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = "." * node.level + (node.module or "")
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def test_passes_never_import_kernels():
    files = sorted((PKG / "recognise" / "fx").glob("*.py"))
    assert files
    for f in files:
        bad = [m for m in _imports(f) if "kernels" in m.split(".") or m.split(".")[0] == "triton"
               or m.lstrip(".").startswith("ops.triton_moe")]
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_kernels_hold_only_triton_jit_functions():
    for f in sorted((PKG / "kernels").glob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                decos = [ast.unparse(d) for d in node.decorator_list]
                assert any(d.startswith(("triton.jit", "tl.jit")) for d in decos), \
                    f"{f.name}: {node.name} is not @triton.jit (kernels/ is for Triton code only)"
            assert not isinstance(node, ast.ClassDef), f"{f.name}: class {node.name} in kernels/"


def test_no_top_level_kernels_or_passes_package():
    for name in ("kernels", "passes"):
        assert not (ROOT / name).exists(), f"top-level {name}/ would shadow HF's `{name}` package"
