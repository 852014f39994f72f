"""FX passes over Dynamo's torch-level graph, one concern per file. Passes never import kernels."""
