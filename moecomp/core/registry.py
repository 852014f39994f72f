"""An ordered registry of named strategies: the rewrites ``optimize`` tries on a block (``api/rewrites.py``) and
the recognisers a block goes through (``recognise/recognise.py``) are each one :class:`Registry`, walked in order.

Each strategy has a ``name`` (unique in its registry; the key it counts under in ``moecomp.counters``).
``register(strategy, before=name)`` inserts one (at the end without ``before``), ``unregister(name)`` removes one
and returns it; ``names()`` is the order. A walk iterates over a copy, so a strategy may (un)register others.
"""

from __future__ import annotations


class Registry:
    def __init__(self, what: str, strategies=()):
        self.what = what  # what its strategies are, for error messages ("rewrite", "recogniser")
        self._items: list = []
        for s in strategies:
            self.register(s)

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._items)

    def __iter__(self):
        return iter(tuple(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, name: str):
        for s in self._items:
            if s.name == name:
                return s
        raise KeyError(f"no {self.what} named {name!r} (registered: {', '.join(self.names())})")

    def register(self, strategy, before: str | None = None):
        """Add ``strategy`` before the one named ``before`` (default: last); returns it."""
        name = getattr(strategy, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"register: strategy must have a non-empty str name, got {name!r}")
        if name in self.names():
            raise ValueError(f"register: a {self.what} named {name!r} is already registered; unregister it first")
        if before is None:
            self._items.append(strategy)
            return strategy
        if before not in self.names():
            raise ValueError(f"register: before must name a registered {self.what} ({', '.join(self.names())}), "
                             f"got {before!r}")
        self._items.insert(self.names().index(before), strategy)
        return strategy

    def unregister(self, name: str):
        """Remove the strategy named ``name``; returns it (``register`` puts it back)."""
        if name not in self.names():
            raise ValueError(f"unregister: name must be a registered {self.what} ({', '.join(self.names())}), "
                             f"got {name!r}")
        s = self[name]
        self._items.remove(s)
        return s
