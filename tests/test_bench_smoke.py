"""CPU smoke test of benchmarks/bench_moe.py: tiny blocks, the correctness check and the table (no timing asserts);
the vLLM peer under the Triton interpreter (subprocess), the synthetic routing modes, report.py's table and plot."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "benchmarks")
VLLM_PEER_DIR = os.environ.get("MOECOMP_VLLM_PEER", os.path.join(os.path.dirname(ROOT), "shared", "peers",
                                                                  "vllm_fused_moe"))


def _load(name):
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    return importlib.import_module(name)


pytest.importorskip("transformers")
bench = _load("bench_moe")
report = _load("report")


def _layer_modules():
    """bench_moe's parts (benchmarks/layer/*.py)."""
    import pkgutil

    pkg = importlib.import_module("layer")
    return [importlib.import_module(f"layer.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]


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
    assert fams == list(bench.GRID_FAMILIES)
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


def test_new_json_fields(tiny_run):
    """Routing mode, the vLLM peer's status, per-cell routing stats and achieved TB/s / TFLOP/s."""
    res, out = tiny_run
    on_disk = json.loads(out.read_text())
    for r in (res, on_disk):
        assert r["schema"] == 2
        assert r["dtype"] == "bf16" and r["init"]["dtype"] == "torch.bfloat16"
        assert r["ceilings"]["matmul_dtype"] == "bf16"
        assert r["tolerance"] == bench.policy.BENCH_TOLERANCE  # the bf16 rule, unchanged
        assert r["breakdown"] is None  # --breakdown is off by default
        assert not any("breakdown" in c for f in r["families"] for c in f["cells"])
        assert r["routing"]["mode"] == "real" and r["routing"]["method"]
        assert r["vllm_peer"]["timed"] is False  # not among --peers here
    ce = res["ceilings"]
    for fam in res["families"]:
        # the block's own router module (owner of the recognised router weight), where it returns transformers'
        # (logits, weights, ids); Llama 4's returns (scores, logits): routed from the spec instead
        assert fam["hf_router"] == (None if fam["name"] == "llama4" else "gate"), (fam["name"], fam["hf_router"])
        for cell in fam["cells"]:
            rt = cell["routing"]
            assert rt["mode"] == "real" and rt["distinct_experts"] == cell["floor"]["distinct_experts"]
            assert 0 < rt["busiest_expert_token_frac"] <= 1
            assert fam["hf_router"] is None or rt["hf_router_match"] > 0.5  # (no HF router to compare with: Llama 4)
            assert "planned_match" not in rt
            for p in ("hf_grouped_mm", "moecomp"):
                a = cell["achieved"][p]
                ms = cell["paths"][p]["best_ms"]
                assert math.isclose(a["tb_per_s"], cell["floor"]["bytes"] / ms / 1e9)
                assert math.isclose(a["tflop_per_s"], cell["floor"]["flops"] / ms / 1e9)
                assert math.isclose(a["copy_ceiling_frac"], a["tb_per_s"] * 1e12 / ce["copy_bytes_per_s"])
                assert math.isclose(a["matmul_ceiling_frac"], a["tflop_per_s"] * 1e12 / ce["matmul_flops_per_s"])


def test_spec_is_the_recognisers(tiny_run, monkeypatch):
    """The benchmark has no recogniser of its own: per family, the spec it timed is ``match_block``'s for that block
    (the one call ``block_spec`` makes, watched: a second capture of each block cost seconds) and its tensors are
    ``bound_tensors``' (the block's own parameters), keyed by MOE_ARGS."""
    from moecomp.recognise import recognise
    from moecomp.bind.bind import bound_tensors
    from moecomp.core.args import MOE_ARGS

    calls, real_match = [], recognise.match_block

    def match_block(block, *a, **kw):
        calls.append((block, real_match(block, *a, **kw)))
        return calls[-1][1]

    monkeypatch.setattr(recognise, "match_block", match_block)
    res, _ = tiny_run
    timed = {f["name"]: f for f in res["families"]}
    for fi, fam in enumerate(bench.FAMILIES[n] for n in bench.GRID_FAMILIES):
        _, block = bench.build_block(fam, True, torch.device("cpu"), 1000 * fi)  # the run's seed (--seed 0)
        rec = {}
        calls.clear()
        spec, tensors = bench.block_spec(block, rec)
        assert len(calls) == 1 and calls[0][0] is block, fam.name
        m = calls[0][1].match
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
        assert (spec.shared is not None) == (tensors["shared_w1"] is not None) == (fam.name in ("qwen2", "deepseek", "llama4"))
        assert (tensors["shared_gate_w"] is not None) == (fam.name == "qwen2")


def test_no_spec_of_its_own():
    import dataclasses
    import inspect

    for gone in ("spec_mixtral", "spec_qwen_style", "spec_qwen2", "spec_deepseek_v3", "_experts", "_act", "_ACTS"):
        assert not hasattr(bench, gone), gone
    assert "spec_fn" not in {f.name for f in dataclasses.fields(bench.Family)}
    src = inspect.getsource(bench) + "".join(inspect.getsource(m) for m in _layer_modules())  # bench_moe + its parts
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
    assert len(rows) == len(bench.GRID_FAMILIES) * 2
    for fam in (bench.FAMILIES[n] for n in bench.GRID_FAMILIES):
        assert any(r.startswith(f"| {fam.label} (") for r in rows), fam.label
    head = next(ln for ln in table.splitlines() if ln.startswith("| family"))
    for col in ("floor", "HF grouped_mm", "moecomp", "moecomp / best HF peer", "moecomp / floor", "moecomp / best peer",
                "moecomp TB/s (copy ceiling", "moecomp TFLOP/s (matmul ceiling"):
        assert col in head
    assert "vLLM" not in head  # neither measured nor a PEERS.md figure (tiny sizes)
    assert "Geometric means" in table and "moecomp / best peer:" in table
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
    from moecomp.core.spec import MoESpec

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
        assert r["ttft_ms"] > 0
        if r["path"].startswith("one_liner"):  # the TTFT call's breakdown; the timed call replayed (warm)
            assert 0 < r["ttft_host_setup_ms"] + r["ttft_prefill_host_ms"] <= r["ttft_call_ms"] <= r["ttft_ms"]
            assert r["eager_steps"] is not None and r["captures"] == 0
    assert json.loads(out.read_text())["rows"]


def test_bench_generate_repeat_summary():
    """--repeat: the engine's paths run again interleaved; the summary gives each path's median, range and ratio to the
    plain one-liner's median, and nothing when every path ran once."""
    gen = _load("bench_generate")
    rows = [dict(model="q", batch=1, path=p, decode_ms=ms) for p, ms in
            [("hf", 9.0), ("one_liner", 1.0), ("one_liner_fused", 1.2), ("one_liner", 1.4), ("one_liner_fused", 0.9),
             ("one_liner", 1.1), ("one_liner_fused", 1.0)]]
    rows.append(dict(model="q", batch=1, path="one_liner_fused", error="X"))
    out = gen.repeat_summary(rows)
    line = next(ln for ln in out if "| one_liner_fused |" in ln)
    assert "| 3 | 1.000 | 0.900 - 1.200 | 0.909 |" in line, line  # median 1.0 over one_liner's median 1.1
    assert "| 3 | 1.100 | 1.000 - 1.400 | 1.000 |" in next(ln for ln in out if "| one_liner |" in ln)
    assert gen.repeat_summary(rows[:3]) == []


def test_plot_generate(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _load("plot_generate")
    src = os.path.join(BENCH_DIR, "results", "nvidia-h200-2026-11-30-5a5420a-generate-rest.json")
    rows, floors = plot.load([src])
    assert ("qwen2", 32, "one_liner") in rows and ("deepseek", 1) in floors
    plot.main([str(tmp_path / "g.png"), src])
    assert (tmp_path / "g.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------------ report.py, synthetic
def _fake_result(vllm_ms, vllm_ok=True, peers_md=None):
    cells = []
    for T, (hf, mine, vl) in ((1, (2.0, 1.0, vllm_ms)), (16, (4.0, 3.0, vllm_ms))):
        paths = {"hf_grouped_mm": dict(best_ms=hf, check_ok=True), "moecomp": dict(best_ms=mine, check_ok=True)}
        if vl is not None:
            paths["vllm"] = dict(best_ms=vl, check_ok=vllm_ok, rel_err_vs_hf=1e-3 if vllm_ok else 0.5)
        cell = dict(T=T, floor_ms=0.5, floor=dict(bytes=1e9, flops=1e12), paths=paths,
                    achieved={"moecomp": dict(tb_per_s=1e9 / mine / 1e9, tflop_per_s=1e12 / mine / 1e9)},
                    check=dict(rel_err=1e-3, ok=True, tolerance=0.02))
        if vl is not None:
            cell["check_vllm"] = dict(rel_err=1e-3 if vllm_ok else 0.5, ok=vllm_ok, tolerance=0.02)
        if peers_md:
            cell["peers_md"] = dict(zip(report.PEERS_MD_PATHS, (9.0, 9.0, 9.0, peers_md)))
        cells.append(cell)
    return dict(gpu="fake", ceilings=dict(copy_bytes_per_s=4e12, matmul_flops_per_s=8e14), tolerance=0.02,
                vllm_peer=dict(source="x/vllm_fused_moe.py"), families=[dict(name="f", label="F (1)", cells=cells)])


def test_table_vllm_measured_drops_peers_md_column():
    res = _fake_result(0.5, peers_md=2.0)
    table = report.render_table(res)
    head = next(ln for ln in table.splitlines() if ln.startswith("| family"))
    assert "moecomp / vLLM (measured)" in head and report.VLLM_LABEL not in head
    assert "check: vLLM vs HF rel err" in head and "TB/s (copy ceiling 4)" in head
    assert "TFLOP/s (matmul ceiling 800)" in head
    rows = [ln for ln in table.splitlines() if ln.startswith("| F") or ln.startswith("|  |")]
    cols = [c.strip() for c in rows[0].strip("|").split("|")]
    h = [c.strip() for c in head.strip("|").split("|")]
    assert cols[h.index("moecomp / vLLM (measured)")] == "2.00x"  # 1.0 / 0.5
    assert cols[h.index("moecomp / best peer")] == "2.00x"  # vLLM is the best peer
    assert cols[h.index("moecomp / best HF peer")] == "0.50x"
    assert cols[h.index("moecomp TB/s (copy ceiling 4)")] == "1.00"
    assert "moecomp / vLLM (measured): 3.46x over 2/2 cells" in table  # sqrt(1.0 / 0.5 * 3.0 / 0.5)
    assert "vLLM 0.25x (2 cells)" in table  # reproduction of the PEERS.md vLLM figure (0.5 / 2.0)


def test_table_keeps_peers_md_column_when_vllm_not_measured():
    table = report.render_table(_fake_result(None, peers_md=2.0))
    head = next(ln for ln in table.splitlines() if ln.startswith("| family"))
    assert report.VLLM_LABEL in head and "moecomp / vLLM (PEERS.md)" in head and "(measured)" not in head
    assert "check: vLLM" not in head


def test_failed_vllm_check_is_not_the_best_peer():
    res = _fake_result(0.1, vllm_ok=False)
    cell = res["families"][0]["cells"][0]
    assert report.best_peer(cell) == (2.0, "hf_grouped_mm")
    table = report.render_table(res)
    assert "**WRONG**" in table and "vLLM PEER CHECK FAILURES (2" in table
    assert "moecomp / vLLM (measured): - over 0/2 cells" in table


def test_plot_renders(tiny_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, out = tiny_run
    png = tmp_path / "layer.png"
    assert report.main([str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 5000


# --------------------------------------------------------------------------------------------- routing modes
def _spec(**kw):
    from moecomp.core.spec import MoESpec

    return MoESpec(**dict(dict(num_experts=16, top_k=2, hidden_size=32, intermediate_size=8), **kw))


def test_routing_plan_distributions():
    T = 4000
    uni = bench.RoutingPlan("uniform", _spec(), seed=1).ids(T)
    assert uni.shape == (T, 2) and uni.dtype == torch.long
    assert bool((uni[:, 0] != uni[:, 1]).all())  # k distinct experts per token
    counts = torch.bincount(uni.reshape(-1), minlength=16).double()
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()

    zp = bench.RoutingPlan("zipf", _spec(), seed=1)
    z = zp.ids(T)
    counts = torch.bincount(z.reshape(-1), minlength=16).double()
    by_prob = torch.argsort(zp.probs, descending=True)
    assert int(counts.argmax()) == int(by_prob[0])  # the most popular expert is drawn most
    assert counts[by_prob[0]] > 4 * counts[by_prob[8:]].mean()  # skewed
    assert bool((z[:, 0] != z[:, 1]).all())
    assert math.isclose(float(zp.probs[by_prob[0]] / zp.probs[by_prob[1]]), 2 ** bench.ZIPF_EXPONENT, rel_tol=1e-9)

    oh = bench.RoutingPlan("one-hot", _spec(), seed=1).ids(T)
    assert bool((oh == oh[0]).all()) and oh[0, 0] != oh[0, 1]

    g = _spec(num_experts=32, top_k=8, scoring="sigmoid", n_group=8, topk_group=2, has_correction_bias=True)
    for mode in ("uniform", "zipf", "one-hot"):
        ids = bench.RoutingPlan(mode, g, seed=2).ids(500)
        groups = ids // 4
        assert all(len(set(r)) <= 2 for r in groups.tolist()), mode  # at most topk_group groups per token
        assert all(len(set(r)) == 8 for r in ids.tolist()), mode
    with pytest.raises(ValueError):
        bench.RoutingPlan("real", _spec(), seed=0)


@pytest.mark.parametrize("fam", ["qwen3", "deepseek"])
def test_planted_routing_every_path_same_ids(fam):
    """Planted ids: moecomp's reference routing, HF's own router module and the HF block all follow the drawn ids,
    and moecomp's op (which routes by itself) matches the HF block, i.e. took the same experts."""
    from moecomp.oracle import reference

    f = bench.FAMILIES[fam]
    _, block = bench.build_block(f, True, torch.device("cpu"), 5)
    rec = {}
    spec, tensors = bench.block_spec(block, rec)
    bench.plant_router(tensors, spec, 3)
    router, owner = bench.hf_router(block, rec["bindings"], spec, torch.device("cpu"))
    assert owner == "gate"
    plan = bench.RoutingPlan("zipf", spec, 4)
    planned = plan.ids(64)
    gen = torch.Generator().manual_seed(0)
    x = bench.planted_input(planned, tensors, spec, gen, torch.device("cpu"), torch.bfloat16)
    x2 = x.view(-1, spec.hidden_size)
    with torch.no_grad():
        logits = reference.router_logits(x2, tensors["router_w"], tensors["router_b"], spec)
        _, ids = reference.route(logits, tensors["correction_bias"], spec)
        assert bool(bench.same_sets(ids, planned).all())
        assert bool(bench.same_sets(router(x2)[2], planned).all())
        assert int(bench.routing_ambiguous(logits, tensors["correction_bias"], spec, spec.router_fp32).sum()) == 0
        ref = block(x)
        from moecomp.core.args import MOE_ARGS

        out = torch.ops.moecomp.moe_forward(x2, *[tensors[n] for n in MOE_ARGS], spec.key).view(x.shape)
    assert bench.rel_err(out, ref) < 2e-2


def test_routing_run_zipf(tmp_path):
    res = bench.run(["--device", "cpu", "--tiny", "--families", "deepseek", "--tokens", "16", "--quick",
                     "--routing", "zipf", "--peers", "hf_grouped_mm,moecomp", "--no-save"])
    assert res["routing"]["mode"] == "zipf" and res["routing"]["zipf_exponent"] == bench.ZIPF_EXPONENT
    (fam,) = res["families"]
    assert not fam["errors"] and fam["routing_plan"]["mode"] == "zipf" and fam["routing_plan"]["group_limit"]
    (cell,) = fam["cells"]
    rt = cell["routing"]
    assert rt["planned_match"] == 1.0 and rt["hf_router_match"] == 1.0 and cell["ambiguous_tokens"] == 0
    assert rt["distinct_experts"] == cell["floor"]["distinct_experts"]
    assert "peers_md" not in cell
    for p in ("hf_grouped_mm", "moecomp"):
        assert cell["paths"][p]["check_ok"], (p, cell["paths"][p])
    assert "Routing: **zipf**" in report.render_table(res)


# ------------------------------------------------------------------------------------------------ vLLM peer
_VLLM_SCRIPT = textwrap.dedent("""
    import json, os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    if not os.environ.get("MOECOMP_TEST_PLAIN_INTERPRETER"):  # tests/conftest.py's interpreter speed-up, here too
        sys.path.insert(0, {tests_dir!r})
        from conftest import skip_repatching_nested_calls
        skip_repatching_nested_calls()
        sys.path.pop(0)
    sys.path.insert(0, {bench_dir!r})
    import torch
    import bench_moe as bench
    import report
    dev = torch.device("cpu")
    fused, info = bench.load_vllm_peer({peer!r}, dev)
    assert fused is not None, info
    out = dict(info=info, direct={{}})
    # fp32 blocks: the peer path (HF router + vLLM's kernel + torch shared expert) against the HF block itself
    bench.set_dtype(torch.float32)
    for name in ("mixtral", "qwen2", "deepseek"):
        cfg, block = bench.build_block(bench.FAMILIES[name], True, dev, 3)
        rec = {{}}
        spec, tensors = bench.block_spec(block, rec)
        assert bench.vllm_unsupported(spec, tensors) is None
        assert all(t is None or t.dtype == torch.float32 for t in tensors.values())
        router, owner = bench.hf_router(block, rec["bindings"], spec, dev)
        x = torch.randn(1, 7, spec.hidden_size, generator=torch.Generator().manual_seed(1))
        bench.set_experts_impl(block, cfg, "eager")  # the reference: HF's per-expert loop
        with torch.no_grad():
            ref = block(x)
            errs = [bench.rel_err(bench.make_vllm_fn(fused, spec, tensors, r, torch.float32)(x), ref)
                    for r in (router, None)]  # HF's router module, then moecomp.oracle.reference.route
        out["direct"][name] = dict(owner=owner, rel_err=errs)
    bench.set_dtype(torch.bfloat16)
    res = bench.run(["--device", "cpu", "--tiny", "--families", "mixtral", "--tokens", "4", "--quick",
                     "--peers", "hf_eager,vllm,moecomp", "--vllm-peer", {peer!r}, "--routing", "zipf", "--no-save",
                     "--breakdown", "mixtral:4"])
    out["run"] = res
    out["table"] = report.render_table(res)
    # --dtype fp8: vLLM's fp8 block path on the tiny fp8 Mixtral block (H = I = 128), next to moecomp's
    res8 = bench.run(["--device", "cpu", "--tiny", "--families", "mixtral", "--tokens", "4", "--quick",
                      "--dtype", "fp8", "--peers", "moecomp_fp8,vllm", "--vllm-peer", {peer!r},
                      "--no-save"])
    out["fp8"] = res8
    out["fp8_table"] = report.render_table(res8)
    print("RESULT " + json.dumps(out, default=str))
""")


@pytest.fixture(scope="module")
def vllm_interp():
    """The script above in a subprocess under TRITON_INTERPRET=1 (Triton reads the variable at kernel creation and
    launch), once for the module: its parsed RESULT."""
    if not os.path.isfile(os.path.join(VLLM_PEER_DIR, "vllm_fused_moe.py")):
        pytest.skip(f"no vLLM peer at {VLLM_PEER_DIR}")
    pytest.importorskip("triton")
    code = _VLLM_SCRIPT.format(bench_dir=BENCH_DIR, peer=VLLM_PEER_DIR, tests_dir=os.path.join(ROOT, "tests"))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("OUT", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, (r.stdout[-3000:], r.stderr[-3000:])
    return json.loads(line[len("RESULT "):])


def test_vllm_peer_under_the_interpreter(vllm_interp):
    """The vLLM peer from ../shared/peers/vllm_fused_moe under TRITON_INTERPRET=1: on fp32 Mixtral / Qwen1.5-MoE
    (sigmoid-gated shared expert) / DeepSeek-V3 (grouped routing, shared expert) tiny blocks it matches the HF block;
    in a tiny bench run (zipf routing: the vLLM path takes the planted ids like the others) it is timed (fp32 on the
    interpreter), checked like moecomp and shown as measured in the table."""
    out = vllm_interp
    assert out["info"]["triton_interpret"] is True
    assert set(out["direct"]) == {"mixtral", "qwen2", "deepseek"}
    for name, d in out["direct"].items():
        assert d["owner"] == "gate", name
        assert max(d["rel_err"]) < 1e-4, (name, d)
    res = out["run"]
    assert res["vllm_peer"]["timed"] and res["vllm_peer"]["compute_dtype"] == "torch.float32"
    (fam,) = res["families"]
    assert res["routing"]["mode"] == "zipf"
    assert not fam["errors"] and fam["vllm_router"] == "HF router module 'gate'"
    (cell,) = fam["cells"]
    assert cell["routing"]["planned_match"] == 1.0 and cell["routing"]["hf_router_match"] == 1.0  # zipf, planted
    v = cell["paths"]["vllm"]
    assert v["best_ms"] > 0 and v["compute_dtype"].startswith("float32")
    assert cell["check_vllm"]["ok"] and cell["check_vllm"]["rel_err"] < 2e-2, cell["check_vllm"]
    assert cell["check"]["ok"] and "vllm" in cell["achieved"]
    head = next(ln for ln in out["table"].splitlines() if ln.startswith("| family"))
    assert "| vLLM |" in head and "moecomp / vLLM (measured)" in head and report.VLLM_LABEL not in head
    # --breakdown: the vLLM peer (timed here) is profiled like moecomp
    assert set(cell["breakdown"]) == {"moecomp", "vllm"}
    for name, bd in cell["breakdown"].items():
        assert "error" not in bd and bd["rows"] and bd["wall_us"] > 0 and bd["kernel_us"] >= 0, (name, bd)
        assert bd["timed_best_ms"] == cell["paths"][name]["best_ms"]


# --------------------------------------------------------------------------------------------------- --dtype
def test_fp16_run(tmp_path, monkeypatch):
    """--dtype fp16: every family's block, input and peer in fp16 (the checks' rel errors drop well below bf16's), the
    tighter fp16 tolerance (policy's verify tolerances' ratio), the dtype in the JSON, the table title and the name."""
    monkeypatch.setattr(bench, "HERE", str(tmp_path))  # the default JSON path: <HERE>/results/<gpu>-<date>-<commit>...
    monkeypatch.delenv("OUT", raising=False)
    res = bench.run(["--device", "cpu", "--tiny", "--tokens", "16", "--quick", "--peers", "hf_grouped_mm,moecomp",
                     "--dtype", "fp16"])  # (one T: the dtype's plumbing is the same at every T; tiny_run covers T=1)
    assert bench.DTYPE == torch.bfloat16  # restored after the run
    assert res["fatal"] is None and res["dtype"] == "fp16" and res["init"]["dtype"] == "torch.float16"
    assert res["ceilings"]["matmul_dtype"] == "fp16"
    tol = res["tolerance"]
    assert tol == bench.default_tolerance(torch.float16) and tol < bench.policy.BENCH_TOLERANCE
    assert math.isclose(tol, bench.policy.BENCH_TOLERANCE / 3)
    assert os.path.basename(res["json_path"]).endswith("-fp16-tiny.json")
    assert os.path.dirname(res["json_path"]) == str(tmp_path / "results")
    assert json.loads(open(res["json_path"]).read())["dtype"] == "fp16"
    assert [f["name"] for f in res["families"]] == list(bench.GRID_FAMILIES)
    for fam in res["families"]:
        assert not fam["errors"], fam["errors"]
        for cell in fam["cells"]:
            for name, p in cell["paths"].items():
                assert p.get("error") is None and p["best_ms"] > 0, (fam["name"], cell["T"], name, p)
            chk = cell["check"]
            assert chk["ok"] and chk["tolerance"] == tol, (fam["name"], cell["T"], chk)
            assert chk["rel_err"] < 3e-3, (fam["name"], cell["T"], chk)  # fp16 roundings (bf16's are ~4e-3)
    assert "### MoE block latency, fp16, cpu" in report.render_table(res)


# ----------------------------------------------------------------------------------------------- --breakdown
def test_breakdown_cpu(monkeypatch, capsys):
    """--breakdown family:T,...: moecomp's op profiled in the named cells only, after every timing of the run; per-op
    rows (CPU: self time), wall, kernels (ops) and gaps, all non-negative; a table per cell in the log."""
    order = []
    run_path, prof = bench.run_path, bench.profile_breakdown
    monkeypatch.setattr(bench, "run_path", lambda path, *a, **k: order.append("time") or run_path(path, *a, **k))
    monkeypatch.setattr(bench, "profile_breakdown", lambda *a, **k: order.append("profile") or prof(*a, **k))
    res = bench.run(["--device", "cpu", "--tiny", "--families", "olmoe,qwen3", "--tokens", "1,16", "--quick",
                     "--peers", "hf_grouped_mm,moecomp", "--no-save", "--breakdown", "olmoe:1,qwen3_moe:3,qwen3:16"])
    log = capsys.readouterr().out
    assert order.count("profile") == 2 and order.index("profile") == order.count("time")  # after every timing
    assert res["breakdown"]["cells"] == ["olmoe:1", "qwen3:16"] and res["breakdown"]["not_in_run"] == ["qwen3:3"]
    assert "--breakdown: not in this run (families x T), ignored: qwen3:3" in log
    got = {(f["name"], c["T"]): c.get("breakdown") for f in res["families"] for c in f["cells"]}
    assert {k for k, v in got.items() if v} == {("olmoe", 1), ("qwen3", 16)}
    for (fam, T), cellbd in got.items():
        if not cellbd:
            continue
        assert set(cellbd) == {"moecomp"}  # HF peers are not profiled; no vLLM peer in this run
        bd = cellbd["moecomp"]
        cell = next(c for f in res["families"] if f["name"] == fam for c in f["cells"] if c["T"] == T)
        assert bd["timed_best_ms"] == cell["paths"]["moecomp"]["best_ms"]
        assert bd["activities"].startswith("cpu") and bd["reps"] == bench.BREAKDOWN_REPS
        assert bd["rows"] and any(r["name"] == "moecomp::moe_forward" for r in bd["rows"])
        for r in bd["rows"]:
            assert r["name"] and r["calls"] > 0 and r["total_us"] >= 0 and r["share"] >= 0, r
        for k in ("wall_us", "wall_us_unprofiled", "kernel_us", "gap_us", "gap_share", "launches"):
            assert bd[k] >= 0, (k, bd[k])
        assert math.isclose(bd["kernel_us"], sum(r["total_us"] for r in bd["rows"]))
        assert math.isclose(bd["gap_us"], bd["wall_us"] - bd["kernel_us"])
        assert f"[breakdown {fam} T={T} moecomp] cpu" in log
    assert "| (gaps: wall - ops) |" in log
    assert "[breakdown olmoe T=1 moecomp]" in report.render_breakdowns(res)
    with pytest.raises(SystemExit):
        bench.parse_breakdown("qwen3", ["qwen3"], [1])


def test_breakdown_cuda_rows():
    """The CUDA side of --breakdown (no GPU here): device activities from kineto, grouped by name, memcpy / memset
    kept as their own kinds; CPU-side events left out."""

    class Ev:
        def __init__(self, name, dev, ns):
            self._n, self._d, self._ns = name, dev, ns

        def name(self):
            return self._n

        def device_type(self):
            return self._d

        def duration_ns(self):
            return self._ns

    evs = [Ev("moe_gemm_kernel", "DeviceType.CUDA", 4000), Ev("moe_gemm_kernel", "DeviceType.CUDA", 6000),
           Ev("Memset (Device)", "DeviceType.CUDA", 500), Ev("cudaLaunchKernel", "DeviceType.CPU", 9000)]
    results = type("R", (), {"events": lambda self: evs})()
    prof = type("P", (), {"profiler": type("K", (), {"kineto_results": results})()})()
    rows = sorted(bench._device_rows(prof, cuda=True))
    assert rows == [("Memset (Device)", "memset", 1, 0.5), ("moe_gemm_kernel", "kernel", 2, 10.0)]
    bd = dict(activities="cuda", reps=2, wall_us=8.0, wall_us_unprofiled=7.0, kernel_us=5.25, gap_us=2.75,
              gap_share=2.75 / 8, launches=1.5, timed_best_ms=0.007,
              rows=[dict(name="moe_gemm_kernel", kind="kernel", calls=1, total_us=5.0, share=5 / 8)])
    text = report.render_breakdown("qwen3", 1, "moecomp", bd)
    assert "| `moe_gemm_kernel` | kernel | 1 | 5.0 | 62.5% |" in text
    assert "| (gaps: wall - kernels) | | | 2.8 | 34.4% |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_diag_kernels_refuses_without_cuda(capsys):
    """benchmarks/diag_kernels.py imports (its tile lists are well-formed) and refuses to run without a GPU."""
    diag = _load("diag_kernels")
    assert diag.main(["--parts", "route"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert all(len(t) in (5, 6) for tiles in diag.TMA_TILES.values() for t in tiles)
    assert all(bt >= 1 and nw >= 1 for bt, nw in diag.ROUTE_TILES)


# ------------------------------------------------------------------------------------------------- --dtype fp8
def _fake_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                            use_fast_accum=False):
    """torch._scaled_grouped_mm's 2-D x 3-D contract in plain torch (the CPU has no kernel): rows [offs[g-1],
    offs[g]) of a (e4m3, row scales) times b[g] (e4m3 [K, N] column-major, per-column scales), bf16 out."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(-1) == 1 and b.stride(-2) == 1
    assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[-1]) and offs.dtype == torch.int32
    out = torch.empty(a.shape[0], b.shape[-1], dtype=out_dtype or torch.bfloat16)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = ((a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g])).to(out.dtype)
        start = end
    return out


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """A tiny --dtype fp8 run of Qwen1.5-MoE (sigmoid-gated shared expert) and DeepSeek-V3 (grouped routing, shared
    expert), every path; torch._scaled_grouped_mm stood in by its contract in torch (no CPU kernel), no vLLM peer."""
    out = tmp_path_factory.mktemp("bench_fp8") / "fp8.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OUT", raising=False)
        mp.setattr(torch, "_scaled_grouped_mm", _fake_scaled_grouped_mm, raising=False)
        res = bench.run(["--device", "cpu", "--tiny", "--dtype", "fp8", "--families", "qwen2,deepseek", "--tokens",
                         "4", "--quick", "--out-json", str(out)])
    return res, out


def test_fp8_run_paths_checks_and_floor(fp8_run):
    """--dtype fp8: the block's experts (routed and shared) in e4m3 with 128x128 block scales; moecomp's op in its
    three modes, moecomp bf16 and _scaled_grouped_mm run and pass their checks (against the dequantized references,
    the row-wise one, the HF block); the HF peers and the missing vLLM peer are n/a with a reason; the floor counts
    fp8 bytes at the fp8 matmul rate; the quantization error is reported, the ratios and targets are in the JSON."""
    res, out = fp8_run
    assert res["fatal"] is None and res["dtype"] == "fp8" and res["init"]["dtype"] == "torch.bfloat16"
    f8 = res["fp8"]
    assert f8["tolerance"] == bench.fp8.FP8_TOLERANCE and f8["mode_env"] == "MOECOMP_FP8_MODE"
    assert f8["quant"] == bench.fp8.quant_spec().key and f8["targets"]["small_speedup"] == 1.7
    assert f8["matmul_rate"] == "fp8_matmul_flops_per_s" and res["ceilings"]["fp8_matmul_flops_per_s"] > 0
    assert f8["scaled_grouped_mm"]["available"] and set(f8["summary"]) >= {"geomean", "speedup_met", "vllm_missed"}
    assert os.environ.get("MOECOMP_FP8_MODE") is None  # set per path only
    assert json.loads(out.read_text())["fp8"]["summary"]["geomean"]
    assert [f["name"] for f in res["families"]] == ["qwen2", "deepseek"]
    for fam in res["families"]:
        assert not fam["errors"], fam["errors"]
        assert fam["fp8"]["spec"].count('"fp8_e4m3"') == 2  # routed and shared quant
        assert set(fam["fp8"]["weight_bytes"]) == {"w13", "w2", "shared_w1", "shared_w3", "shared_w2"}
        (cell,) = fam["cells"]
        assert list(cell["paths"]) == list(bench.FP8_PEERS)
        for p in ("hf_eager", "hf_grouped_mm", "compile"):
            assert cell["paths"][p]["skipped"] == bench.fp8.HF_NA
        assert "vLLM" in cell["paths"]["vllm_fp8"]["skipped"]  # not found, not asked for by name: n/a, not an error
        for p in bench.FP8_PATHS[:3] + ("scaled_grouped_mm", "moecomp"):
            pr = cell["paths"][p]
            assert pr.get("error") is None and pr["best_ms"] > 0 and pr["check_ok"], (fam["name"], p, pr)
        cf = cell["check_fp8"]
        assert set(cf) == {"moecomp_fp8", "moecomp_fp8_w8a8", "moecomp_fp8_w8a16", "scaled_grouped_mm"}
        assert all(c["ok"] and c["rel_err"] < 1e-2 for c in cf.values()), cf
        assert cf["moecomp_fp8"]["ran"] in ("w8a8", "w8a16") and "mode_honoured" in cf["moecomp_fp8_w8a16"]
        assert "row-wise" in cf["scaled_grouped_mm"]["against"]
        assert cell["check"]["ok"]  # moecomp bf16 vs the HF block, as in bf16 runs
        qe = cell["quant_error"]
        assert 5e-3 < qe["rel_err"] < 0.3 and 0 < qe["between_w8a8_and_w8a16"] < 0.3, qe
        fl, fl16 = cell["floor"], cell["floor_bf16"]
        assert fl["matmul_rate"] == "fp8_matmul_flops_per_s" and fl["distinct_experts"] == fl16["distinct_experts"]
        assert fl["flops"] == fl16["flops"] and 0.4 * fl16["bytes"] < fl["bytes"] < 0.8 * fl16["bytes"]
        assert math.isclose(cell["achieved"]["moecomp"]["tb_per_s"], fl16["bytes"] / cell["paths"]["moecomp"]["best_ms"]
                            / 1e9)
        r = cell["fp8_ratios"]
        assert math.isclose(r["fp8_over_bf16"], cell["paths"]["moecomp_fp8"]["best_ms"]
                            / cell["paths"]["moecomp"]["best_ms"])
        assert r["target_speedup"] == 1.7 and r["target_met"] in (True, False) and r["fp8_over_vllm_fp8"] is None


def test_fp8_table_and_markdown(fp8_run, tiny_run, tmp_path):
    """The fp8 table (its own kind): the paths timed, the ratios, the checks and the n/a paths under it; --update
    writes it between its own markers and leaves the bf16 section as it was (both orders, idempotent)."""
    res, out = fp8_run
    table = report.render_table(res)
    assert table.startswith("### MoE block latency, fp8 (e4m3 experts, 128x128 fp32 block scales")
    head = next(ln for ln in table.splitlines() if ln.startswith("| family"))
    for col in ("floor (fp8)", "| moecomp fp8 |", "moecomp fp8 w8a8", "moecomp fp8 w8a16", "moecomp bf16",
                "_scaled_grouped_mm (row-wise)", "moecomp fp8 / bf16 (target)", "moecomp fp8 / floor",
                "check: moecomp fp8 (ran)", "quant err (vs bf16 block)", "check: bf16 vs HF"):
        assert col in head, col
    assert "vLLM fp8 |" not in head and "HF eager" not in head
    assert "vLLM fp8: n/a in every cell (vLLM peer not loaded" in table
    assert "HF eager: n/a in every cell (n/a in fp8: transformers' FP8 forward" in table
    assert "Geometric means: moecomp fp8 / moecomp bf16:" in table and "Targets (issue 19" in table
    assert "FAIL" not in table
    assert len([ln for ln in table.splitlines() if ln.startswith("| ") and "family" not in ln]) == 2
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\nintro\n")
    _, bf16_json = tiny_run
    assert report.main([str(bf16_json), "--update", str(md)]) == 0
    bf16_section = md.read_text()
    assert report.main([str(out), "--update", str(md)]) == 0
    both = md.read_text()
    fp8_mod = _load("report_fp8")
    assert both.startswith(bf16_section.rstrip("\n")) and both.count(fp8_mod.BEGIN_MARK) == 1
    assert both.count(report.BEGIN_MARK) == 1 and "MoE block latency, bf16" in both
    assert report.main([str(out), str(bf16_json), "--update", str(md)]) == 0  # both at once: each in its section
    assert md.read_text() == both


def test_fp8_missing_peers_are_reasoned():
    """Without torch._scaled_grouped_mm (or its kernel here), or without a vLLM peer, the fp8 paths are n/a with the
    reason, not errors; fp8 names outside --dtype fp8 are refused."""
    fp8_paths = bench.fp8_paths
    why = fp8_paths.sgmm_probe(torch.device("cpu"))
    assert why and ("_scaled_grouped_mm" in why)
    with pytest.MonkeyPatch.context() as mp:
        mp.delattr(torch, "_scaled_grouped_mm", raising=False)
        assert "has no torch._scaled_grouped_mm" in fp8_paths.sgmm_probe(torch.device("cpu"))
    paths = fp8_paths.family_paths(None, None, "refused", None, list(bench.FP8_PEERS), None, {}, False, why,
                                   torch.device("cpu"))
    by = {p.name: p for p in paths}
    assert by["hf_eager"].skip == bench.fp8.HF_NA and by["vllm_fp8"].skip and by["scaled_grouped_mm"].skip
    assert by["moecomp_fp8"].fn is None and "refused" in (by["moecomp_fp8"].error or by["moecomp_fp8"].skip)
    from moecomp.core.spec import MoESpec

    in_out = MoESpec(num_experts=4, top_k=1, hidden_size=64, intermediate_size=32, w_layout="in_out")  # Llama 4's
    by = {p.name: p for p in fp8_paths.family_paths(in_out, None, "cannot quantize", None, list(bench.FP8_PEERS),
                                                    None, {}, False, why, torch.device("cpu"))}
    assert by["moecomp_fp8"].error is None and by["moecomp_fp8"].skip.startswith("n/a: no FP8 checkpoint layout")
    with pytest.raises(SystemExit):
        bench.resolve_peers("moecomp_fp8", is_fp8=False)
    assert bench.resolve_peers("vllm,moecomp", is_fp8=True) == ["vllm_fp8", "moecomp"]


def test_vllm_fp8_under_the_interpreter(vllm_interp):
    """vLLM's fp8 block path (use_fp8_w8a8, 128x128 block scales) on the block's fp8 weights, under the interpreter:
    timed, checked against the dequantized w8a8 reference (the interpreter's looser bound: its e4m3 cast), in the
    table with its ratio."""
    res = vllm_interp["fp8"]
    assert res["vllm_peer"]["timed"] and res["vllm_peer"]["fp8_block"] is True
    (fam,) = res["families"]
    assert not fam["errors"] and fam["vllm_router"] == "HF router module 'gate'"
    (cell,) = fam["cells"]
    v = cell["paths"]["vllm_fp8"]
    assert v["best_ms"] > 0 and v["compute_dtype"].startswith("float32") and "block_shape" in v["note"]
    chk = cell["check_fp8"]["vllm_fp8"]
    assert chk["ok"] and chk["tolerance"] == bench.fp8.FP8_INTERPRET_TOLERANCE and chk["rel_err"] < 0.2, chk
    assert cell["check_fp8"]["moecomp_fp8"]["ok"] and cell["fp8_ratios"]["fp8_over_vllm_fp8"] > 0
    head = next(ln for ln in vllm_interp["fp8_table"].splitlines() if ln.startswith("| family"))
    assert "| vLLM fp8 |" in head and "moecomp fp8 / vLLM fp8" in head and "check: vLLM fp8" in head


def test_fp8_plot(fp8_run, tmp_path):
    pytest.importorskip("matplotlib")
    _, out = fp8_run
    png = tmp_path / "fp8.png"
    assert report.main([str(out), "--plot-fp8", str(png)]) == 0
    assert png.stat().st_size > 5000


def test_quant4_bench_smoke(tmp_path):
    """bench_quant4 on CPU (tiny gpt-oss block, T = 4): every moecomp path runs and matches its reference (the
    quantized paths the dequantized reference, bf16 the HF block), the ratios and floors are filled, the table
    renders; the vLLM peer is reported as not loaded, not faked."""
    q4 = _load("bench_quant4")
    old = os.environ.pop("OUT", None)
    try:
        res = q4.main(["--device", "cpu", "--tiny", "--models", "gpt_oss20b", "--tokens", "4",
                       "--out", str(tmp_path / "q4")])
    finally:
        if old is not None:
            os.environ["OUT"] = old
    saved = json.loads((tmp_path / "q4.json").read_text())
    assert [c["T"] for c in saved["models"][0]["cells"]] == [4]
    for cell in saved["models"][0]["cells"]:
        for name in ("moecomp_bf16", "moecomp_mxfp4", "moecomp_int4", "plain_moecomp_fp8", "plain_moecomp_mxfp4"):
            pr = cell["paths"][name]
            assert pr["best_ms"] > 0 and pr["check_ok"], (name, pr)
        assert "not loaded" in cell["paths"]["plain_vllm_bf16"]["error"]
        assert cell["ratios"]["mxfp4_vs_bf16"] > 0 and cell["floors"]["moecomp_mxfp4"]["floor_ms"] > 0
        # 4-bit floors count half a byte a weight: below the bf16 floor's bytes by ~4x
        assert cell["floors"]["moecomp_mxfp4"]["bytes"] < cell["floors"]["moecomp_bf16"]["bytes"] / 3
    assert "| gpt-oss-20b | 4 |" in q4.table(res)
