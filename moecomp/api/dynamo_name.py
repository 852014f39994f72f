"""``torch.compile(model, backend="moecomp")`` after ``import moecomp``, installed or not.

torch finds backend names through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), which exists only
once moecomp is pip-installed. Run from a source tree (``PYTHONPATH``), the name was unknown (``InvalidBackend``).
So ``import moecomp`` also adds the same entry to torch's table of backend names the moment that table's module
(``torch._dynamo.backends.registry``) is loaded: at once if Dynamo is imported already, else by an import hook
(``import_hooks``), so ``import moecomp`` still imports no Dynamo. The entry is the entry point itself
(``moecomp.api.backend:moecomp_backend``), loaded by torch on the first lookup, as an installed one would be: an
installed entry point, or ``moecomp.api.backend`` imported first, finds it there and changes nothing.
"""

from __future__ import annotations

from ..hf.import_hooks import when_imported

REGISTRY = "torch._dynamo.backends.registry"
NAME, VALUE, GROUP = "moecomp", "moecomp.api.backend:moecomp_backend", "torch_dynamo_backends"


def add_backend_name() -> bool:
    """Put "moecomp" in torch's backend-name table if it is not there; True if it is there afterwards. Torch's
    private table (``_BACKENDS``: name -> entry point or None) is read defensively: on another layout nothing is
    changed and the installed entry point remains the way in."""
    import sys

    reg = sys.modules.get(REGISTRY)
    table = getattr(reg, "_BACKENDS", None)
    if not isinstance(table, dict):
        return False
    if NAME not in table:
        from importlib.metadata import EntryPoint

        table[NAME] = EntryPoint(name=NAME, value=VALUE, group=GROUP)
    return True


def install() -> None:
    when_imported(REGISTRY, add_backend_name)
