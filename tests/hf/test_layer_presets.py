"""``moecomp.testing.LAYER_PRESETS["llama4_scout"]`` (the GPU tests' and the tuner's Llama 4 Scout sizes) describes
the block the FX pass reads from transformers' own ``Llama4TextMoe``: every spec field but the sizes and top-k (the
tiny model's config sets top-2) equal to the recognised tiny block's."""

import json

from moecomp import scan
from moecomp.coverage import families as fam
from moecomp.testing import LAYER_PRESETS

SIZES = ("hidden_size", "intermediate_size", "num_experts", "top_k")


def test_llama4_scout_preset_is_what_the_fx_pass_reads():
    built = fam.build_tiny("llama4")
    model = built[0] if isinstance(built, tuple) else built
    blocks = scan(model).blocks
    assert len(blocks) >= 1 and all(b.method == "fx" for b in blocks), [(b.name, b.method, b.reason) for b in blocks]
    got = json.loads(blocks[0].spec.key)
    want = json.loads(LAYER_PRESETS["llama4_scout"].key)
    assert {k: (want[k], got[k]) for k in want if k not in SIZES + ("shared",) and want[k] != got[k]} == {}
    sh_w, sh_g = want["shared"], got["shared"]
    assert {k: (sh_w[k], sh_g[k]) for k in sh_w if k != "intermediate_size" and sh_w[k] != sh_g[k]} == {}
    assert (want["num_experts"], want["top_k"], want["hidden_size"], want["intermediate_size"]) == (16, 1, 5120, 8192)
