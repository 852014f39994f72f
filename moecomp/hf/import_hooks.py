"""Run a function right after a module is imported, without importing it (``import moecomp`` stays cheap).

    when_imported("torch._dynamo.backends.registry", fn)   # fn() now if it is loaded, else right after its import

Used for the names moecomp adds to other libraries' registries: transformers' experts interfaces
(``hf/experts_interface.py``) and torch.compile's backend table (``api/dynamo_name.py``). Each hook is a meta-path
finder that removes itself on first use; it never changes how the module is found or loaded, and any problem in it
leaves the import to the other finders.
"""

from __future__ import annotations

import sys


class RegisterOnImport:
    """Meta-path finder: calls ``fn()`` right after ``target`` is imported (once)."""

    def __init__(self, target: str, fn):
        self.target = target
        self.fn = fn

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        uninstall(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = getattr(spec, "loader", None)
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            orig = loader.exec_module

            def exec_module(module, _orig=orig, _fn=self.fn):
                _orig(module)
                _fn()

            loader.exec_module = exec_module
            return spec
        except Exception:  # pragma: no cover - let the regular finders import it
            return None


def uninstall(finder: RegisterOnImport) -> None:
    if finder in sys.meta_path:
        sys.meta_path.remove(finder)


def when_imported(target: str, fn) -> RegisterOnImport | None:
    """``fn()`` now if ``target`` is loaded (returns None), else right after it is imported (returns the finder)."""
    if target in sys.modules:
        fn()
        return None
    finder = RegisterOnImport(target, fn)
    sys.meta_path.insert(0, finder)
    return finder
