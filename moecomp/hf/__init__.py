"""What plugs into transformers: the ``"moecomp"`` experts implementation (experts_interface), the ``"moecomp"``
EP implementation (ep_interface) and the import hooks that register both when transformers loads (import_hooks).
Below the binder: an experts-only binding hands the experts to this interface."""
