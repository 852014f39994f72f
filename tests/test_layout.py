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
                # Gluon (Triton's own lower-level dialect) is Triton code too: docs/ARCHITECTURE.md says why
                assert any(d.startswith(("triton.jit", "tl.jit", "gluon.jit")) for d in decos), \
                    f"{f.name}: {node.name} is not @triton.jit / @gluon.jit (kernels/ is for Triton code only)"
            assert not isinstance(node, ast.ClassDef), f"{f.name}: class {node.name} in kernels/"


def test_no_top_level_kernels_or_passes_package():
    for name in ("kernels", "passes"):
        assert not (ROOT / name).exists(), f"top-level {name}/ would shadow HF's `{name}` package"


# ------------------------------------------------------------------------------------------------- sizes
MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 100


def _sources():
    for top in (PKG, ROOT / "benchmarks"):
        for f in sorted(top.rglob("*.py")):
            if "results" not in f.relative_to(ROOT).parts:
                yield f


def test_files_and_functions_stay_small():
    """No file in moecomp/ or benchmarks/ over 600 lines, no Python function over 100 (``@triton.jit`` kernels
    excepted: one kernel is one launch)."""
    files = list(_sources())
    assert len(files) > 100
    long_files, long_functions = [], []
    for f in files:
        text = f.read_text(encoding="utf-8")
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append((str(f.relative_to(ROOT)), len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    continue
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append((str(f.relative_to(ROOT)), node.name, n))
    assert long_files == [] and long_functions == [], (long_files, long_functions)


def test_benchmarks_import_no_cycle():
    """The benchmark scripts import each other (by module name, benchmarks/ on the path) without a cycle."""
    bench = ROOT / "benchmarks"
    names = {f.stem for f in bench.glob("*.py")}
    graph = {n: {m.split(".")[0] for m in _imports(bench / f"{n}.py")} & names - {n} for n in names}
    state = {}

    def visit(n, stack):
        state[n] = "open"
        for m in sorted(graph[n]):
            assert state.get(m) != "open", " -> ".join(stack + [n, m])
            if m not in state:
                visit(m, stack + [n])
        state[n] = "done"

    for n in sorted(names):
        if n not in state:
            visit(n, [])
