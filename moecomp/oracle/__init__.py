"""The plain-torch oracle: what a MoESpec computes, written once without the op's code
(tests/test_oracle_independent.py)."""
