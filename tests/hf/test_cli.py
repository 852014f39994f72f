"""python -m moecomp {scan, coverage, demo}."""

import json

import pytest
import torch

from moecomp import cli
from moecomp.cli import demo


@pytest.fixture
def qwen2_moe_folder(tmp_path):
    from transformers import Qwen2MoeConfig

    cfg = Qwen2MoeConfig(num_hidden_layers=3, hidden_size=128, moe_intermediate_size=64, num_experts=12,
                         num_experts_per_tok=3, shared_expert_intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, intermediate_size=256, dtype="bfloat16")
    cfg.save_pretrained(tmp_path)
    return tmp_path


def test_scan_folder_table(qwen2_moe_folder, capsys):
    assert cli.main(["scan", str(qwen2_moe_folder)]) == 0
    out = capsys.readouterr().out
    assert out.count("model.layers.") == 3 and "unverified" in out and "meta device" in out


def test_scan_config_json(qwen2_moe_folder, capsys):
    assert cli.main(["scan", str(qwen2_moe_folder / "config.json"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["summary"] == {"blocks": 3, "unverified": 3}
    b = d["blocks"][0]
    assert (b["num_experts"], b["top_k"], b["hidden"], b["intermediate"]) == (12, 3, 128, 64)
    assert b["spec"]["shared"]["gate"] == "sigmoid" and b["spec"]["shared"]["intermediate_size"] == 256
    # bf16: 3 experts x 3 x 128 x 64 + router 12 x 128 + shared (3 x 256 x 128 + gate 128), 2 bytes each
    assert b["bytes_per_token"] == 2 * (3 * 3 * 128 * 64 + 12 * 128 + 3 * 256 * 128 + 128)


def test_scan_bad_path(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["scan", str(tmp_path / "missing")])


def test_coverage_one_family(tmp_path, capsys):
    out = tmp_path / "coverage.md"
    threads = torch.get_num_threads()
    try:
        assert cli.main(["coverage", "--out", str(out), "olmoe"]) == 0
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    assert "| olmoe | OlmoeForCausalLM | equal | 2/2 |" in text and "1 families; 1 build tiny; 1 rewritten" in text


def test_demo_cpu(capsys):
    res = demo.run("cpu", layers=1, seq=16, reps=1)
    out = capsys.readouterr().out
    assert res["ok"] and res["rewritten"] == res["blocks"] == 1
    assert res["max_rel"] <= demo.CPU_TOL
    assert "before" in out and "after" in out and "OK" in out
    # decode steps timed inside each call (a difference of two calls' medians printed a negative time once)
    assert res["decode_ms_before"] > 0 and res["decode_ms_after"] > 0
    assert res["decode_loop_before"] == res["decode_loop_after"] == "transformers' loop"  # CPU models keep HF's loop


def test_scan_reads_code_not_comments(tmp_path, capsys):
    """MiniMax-M3's router says "# Sigmoid scoring (not softmax)" above `F.sigmoid(...)`: on the meta device the
    attribute fallback reads the source, and a comment must not count as code."""
    from moecomp.coverage import families

    model, _ = families.build_tiny("minimax_m3_vl")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model.config.to_dict()))
    assert cli.main(["scan", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    routers = [b["router"] for b in rep["blocks"]]
    assert routers and all(r.startswith("sigmoid") for r in routers), routers


def test_scan_meta_says_when_experts_only_is_possible(tmp_path, capsys):
    """Gemma-4's router sits in the decoder layer (no whole-block rewrite); on the meta device the scan says that
    its experts module could still run moecomp's experts path once weights are loaded."""
    from moecomp.coverage import families

    model, _ = families.build_tiny("gemma4")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(model.config.to_dict()))
    assert cli.main(["scan", str(path), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["blocks"] and all("experts only" in b["reason"] for b in rep["blocks"]), rep["blocks"]
