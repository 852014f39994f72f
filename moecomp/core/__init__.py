"""The data that flows between the stages (the bottom layer; imports nothing of moecomp above it): MoESpec and its
checks, Match / Derived / Reject, BlockParts, the op's argument names, tolerances and probe inputs (policy), the
quantization codecs (quant), the call counters and the attribute snapshot."""
