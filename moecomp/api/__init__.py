"""The API layer: what users call (optimize, scan, load, the compile backend, shard_experts) and the pipelines that
put the stages together (docs/ARCHITECTURE.md)."""
