"""The coverage tool: every transformers MoE family built tiny, optimized and compared (families), and the table of
the results that docs/coverage.md is (markdown; ``python -m moecomp coverage``). Above the API: it runs optimize."""
