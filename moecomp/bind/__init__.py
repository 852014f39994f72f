"""Bind: a verified Match becomes the block's forward (one ``moe_forward`` call): the binder, the experts-only and pair
stand-ins, the runtime fallbacks, and the switch between transformers' experts implementations."""
