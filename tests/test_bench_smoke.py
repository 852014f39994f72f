"""CPU smoke test of benchmarks/bench_moe.py: tiny blocks, the correctness check and the table (no timing asserts)."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "benchmarks")


def _load(name):
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module(name)


pytest.importorskip("transformers")
bench = _load("bench_moe")
report = _load("report")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "result.json"
    old = os.environ.pop("OUT", None)
    try:
        res = bench.run(["--device", "cpu", "--tiny", "--tokens", "1,16", "--quick",
                         "--peers", "hf_grouped_mm,moecomp", "--out-json", str(out)])
    finally:
        if old is not None:
            os.environ["OUT"] = old
    return res, out


def test_every_family_and_T_has_a_checked_row(tiny_run):
    res, out = tiny_run
    assert res["fatal"] is None
    fams = [f["name"] for f in res["families"]]
    assert fams == list(bench.FAMILIES)
    for fam in res["families"]:
        assert not fam["errors"], fam["errors"]
        assert [c["T"] for c in fam["cells"]] == [1, 16]
        for cell in fam["cells"]:
            assert cell["floor_ms"] > 0 and cell["floor"]["distinct_experts"] >= 1
            assert set(cell["paths"]) == {"hf_grouped_mm", "moecomp"}
            for name, p in cell["paths"].items():
                assert p.get("error") is None, (fam["name"], cell["T"], name, p.get("error"))
                assert p["best_ms"] > 0
            chk = cell["check"]
            assert chk["ok"], (fam["name"], cell["T"], chk)
            assert chk["rel_err"] < 5e-2
    # the JSON on disk is the same result and feeds report.py
    on_disk = json.loads(out.read_text())
    assert on_disk["families"][0]["cells"][0]["T"] == 1
    assert on_disk["ceilings"]["copy_bytes_per_s"] > 0


def test_spec_is_the_recognisers(tiny_run):
    """The benchmark has no recogniser of its own: per family, the spec it timed is ``match_block``'s for that block
    and its tensors are ``bound_tensors``' (the block's own parameters), keyed by MOE_ARGS."""
    from moecomp.hf.bind import bound_tensors
    from moecomp.ops.common import MOE_ARGS
    from moecomp.recognise import match_block

    res, _ = tiny_run
    timed = {f["name"]: f for f in res["families"]}
    for fi, fam in enumerate(bench.FAMILIES.values()):
        _, block = bench.build_block(fam, True, torch.device("cpu"), 1000 * fi)  # the run's seed (--seed 0)
        rec = {}
        spec, tensors = bench.block_spec(block, rec)
        m = match_block(block).match
        assert spec == m.spec, fam.name
        assert timed[fam.name]["spec"] == spec.key, fam.name  # what the run timed
        assert timed[fam.name]["recognised"]["method"] == rec["method"] and rec["bindings"], fam.name
        assert tuple(tensors) == MOE_ARGS
        want = bound_tensors(block, m.spec, m.bindings, m.derived)
        own = {p.data_ptr() for p in block.parameters()} | {b.data_ptr() for b in block.buffers()}
        for name, t, w in zip(MOE_ARGS, tensors.values(), want):
            assert (t is None) == (w is None), (fam.name, name)
            if t is not None:
                assert t.data_ptr() == w.data_ptr() and t.shape == w.shape and t.data_ptr() in own, (fam.name, name)
        assert all(tensors[n] is not None for n in ("router_w", "w13", "w2"))
        assert (tensors["correction_bias"] is not None) == spec.has_correction_bias == (fam.name == "deepseek")
        assert (spec.shared is not None) == (tensors["shared_w1"] is not None) == (fam.name in ("qwen2", "deepseek"))
        assert (tensors["shared_gate_w"] is not None) == (fam.name == "qwen2")


def test_no_spec_of_its_own():
    import dataclasses
    import inspect

    for gone in ("spec_mixtral", "spec_qwen_style", "spec_qwen2", "spec_deepseek_v3", "_experts", "_act", "_ACTS"):
        assert not hasattr(bench, gone), gone
    assert "spec_fn" not in {f.name for f in dataclasses.fields(bench.Family)}
    src = inspect.getsource(bench)
    assert "MoESpec(" not in src and "SharedExpertSpec" not in src and "match_block(" in src


def test_refused_block_fails_loudly(monkeypatch, capsys):
    """A block moecomp refuses: BlockRefused with the reject code; in a run, the code in the log and the JSON, no
    moecomp timing (nothing to fall back to), exit status 3."""
    with pytest.raises(bench.BlockRefused) as ei:
        bench.block_spec(torch.nn.Sequential(torch.nn.Linear(8, 8)))
    assert ei.value.code == "NOT_A_BLOCK" and "[NOT_A_BLOCK]" in str(ei.value)

    def refuse(block, record=None):
        if record is not None:
            record["refused"] = dict(code="NOT_RECOGNISED", reason="test")
        raise bench.BlockRefused("NOT_RECOGNISED", "test")

    monkeypatch.setattr(bench, "block_spec", refuse)
    runs, run = [], bench.run
    monkeypatch.setattr(bench, "run", lambda argv: runs.append(run(argv)) or runs[-1])
    rc = bench.main(["--device", "cpu", "--tiny", "--families", "olmoe", "--tokens", "1", "--quick",
                     "--peers", "moecomp", "--no-save"])
    assert rc == 3
    assert "!!!!! olmoe: moecomp refused the block [NOT_RECOGNISED]: test" in capsys.readouterr().out
    (fam,) = runs[0]["families"]
    assert fam["recognised"]["refused"]["code"] == "NOT_RECOGNISED" and "spec" not in fam
    assert any("[NOT_RECOGNISED]" in e for e in fam["errors"])
    mc = fam["cells"][0]["paths"]["moecomp"]
    assert mc["best_ms"] is None and "[NOT_RECOGNISED]" in mc["error"]


def test_table_rows(tiny_run):
    res, _ = tiny_run
    table = report.render_table(res)
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| family")]
    assert len(rows) == len(bench.FAMILIES) * 2
    for fam in bench.FAMILIES.values():
        assert any(r.startswith(f"| {fam.label} (") for r in rows), fam.label
    head = next(ln for ln in table.splitlines() if ln.startswith("| family"))
    for col in ("floor", "HF grouped_mm", "moecomp", "moecomp / best HF peer", "moecomp / floor"):
        assert col in head
    assert "Geometric means" in table
    assert "FAIL" not in table


def test_report_markdown_section(tiny_run, tmp_path):
    res, out = tiny_run
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nintro\n")
    assert report.main([str(out), "--update", str(md)]) == 0
    first = md.read_text()
    assert first.count(report.BEGIN_MARK) == 1 and "intro" in first
    assert report.main([str(out), "--update", str(md)]) == 0  # regenerates in place, no duplicate
    assert md.read_text() == first


def test_routing_ambiguity_flags_exact_ties():
    from moecomp.spec import MoESpec

    spec = MoESpec(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    logits = torch.tensor([[3.0, 1.0, 1.0, -2.0],  # tie at the top-2 boundary
                           [3.0, 2.0, 0.0, -2.0]], dtype=torch.bfloat16)
    amb = bench.routing_ambiguous(logits, None, spec, fp32_router=False)
    assert amb.tolist() == [True, False]
    g = MoESpec(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8, scoring="sigmoid", n_group=4,
                topk_group=1, has_correction_bias=True)
    logits = torch.tensor([[4.0, 3.0, -1, -1, -1, -1, -1, -1], [4.0, 3.0, 4.0, 3.0, -1, -1, -1, -1]])
    amb = bench.routing_ambiguous(logits, torch.zeros(8), g, fp32_router=True)
    assert amb.tolist() == [False, True]  # second row: two groups tie


def test_bench_generate_tiny_cpu(tmp_path):
    """benchmarks/bench_generate.py on tiny CPU models: every path and an engine variant give a row with a floor and
    the one-liner's tokens equal transformers' (fp32)."""
    gen = _load("bench_generate")
    out = tmp_path / "gen.json"
    res = gen.run(["--device", "cpu", "--tiny", "--batches", "1,2", "--models", "qwen2",
                   "--compiled-models", "qwen2", "--compiled-batches", "2", "--variants",
                   "qwen2:2=one_liner_no_fse", "--out-json", str(out)])
    rows = {(r["batch"], r["path"]): r for r in res["rows"]}
    assert not res["errors"] and all("error" not in r for r in res["rows"]), res["errors"]
    assert set(rows) == {(1, p) for p in ("hf", "experts_impl", "optimize_hf", "one_liner")} | {
        (2, p) for p in gen.ALL_PATHS + ("one_liner_no_fse",)}
    for r in res["rows"]:
        assert r["decode_ms"] > 0 and r["floor_decode_ms"] > 0 and r["tokens"]["match"] == 1.0
    assert json.loads(out.read_text())["rows"]


def test_plot_generate(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _load("plot_generate")
    src = os.path.join(BENCH_DIR, "results", "nvidia-h200-2026-11-30-5a5420a-generate-rest.json")
    rows, floors = plot.load([src])
    assert ("qwen2", 32, "one_liner") in rows and ("deepseek", 1) in floors
    plot.main([str(tmp_path / "g.png"), src])
    assert (tmp_path / "g.png").stat().st_size > 1000
