"""Verify: the one check every Match passes before it is bound (op against the block's own forward on probes, the
epilogue a block adds after its MoE part, the pair rewrite's parent-layer check). Imports the binder (it runs the op
the binder would call), never a recogniser."""
