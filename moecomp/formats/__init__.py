"""Quantized formats: the checkpoint readers (checkpoint, mxfp4, gptq) and the modules that hold quantized weights as
stored (PackedExperts, Packed4Linear, the FP8 helpers). Above the ops (their forwards call them) and the oracle."""
