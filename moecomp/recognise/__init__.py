"""Recognise: a block -> one Match or a Reject with its reason. The FX pass over Dynamo's graph (capture, fx/) first,
the readers (structure, fallback, dispatch_reader, pair_reader, ...) and their numeric fits as fallbacks; the graph
rewrites the compile backend runs (fx/rewrite_moe, fse, fp8_linear)."""
