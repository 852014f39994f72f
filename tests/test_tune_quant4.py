"""``python -m moecomp tune --quant4``: a tiny tune of both 4-bit formats under the Triton interpreter (two candidates
per choice; timings meaningless) writes entries that ``tuning.quant4_config`` reads back, and the op run with them equals
the dequantized reference, on the path the entry names; a budget stops between entries and a rerun skips the
finished ones; the tuner's own per-pair reference is the oracle's arithmetic; the random layers are made packed; the
gpt-oss presets are ``gpt_oss_config``'s sizes. One GPU test tunes a small 4-bit layer for real."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moecomp import cli
from moecomp.cli import tune, tune_io, tune_quant4
from moecomp.cli.tune_quant4 import INT4, MXFP4, interpret_spec, packed_layer, pair_reference, scale_args
from moecomp.cli.tune_quant4_run import EXIT_BUDGET
from moecomp.core.args import MOE_ARGS
from moecomp.core.spec import MoESpec, QuantSpec
from moecomp.ops import triton_moe, triton_quant4, triton_quant4_gemv, tuning
from moecomp.oracle import reference

E, I, H, K = tune_quant4.INTERPRET_SHAPE
ARGS = ["--interpret", "--quant4", "both", "--tokens", "1"]
# the op against the fp32 oracle, fp32 x under the interpreter: the kernels' fp32 sums (1e-7 measured) within this
TOL = 1e-4
TOL_GPU = 2e-2  # bf16 x and output on the GPU against the fp32 oracle
interpreted = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="--interpret tests run where the kernels are interpreted (no CUDA)")


def _load(path):
    with open(path) as f:
        return json.load(f)


def _key(quant, e=E, i=I, h=H):
    return tuning.shape_key(e, i, h, tuning.quant4_key(quant))


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One interpreted tune of both formats at T = 1 with the real (wall-clock) timer, read by the tests below."""
    if torch.cuda.is_available():
        pytest.skip("--interpret tests run where the kernels are interpreted (no CUDA)")
    out = tmp_path_factory.mktemp("q4") / "cpu.json"
    assert cli.main(["tune", *ARGS, "--out", str(out)]) == 0
    return out


@pytest.fixture
def lookup(tuned, monkeypatch):
    """The run-time lookup reads the tuned table (its directory) while the test runs; the op on the Triton path."""
    monkeypatch.setattr(tuning, "CONFIG_DIR", tuned.parent)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FORM", "MOECOMP_W4_FOLD", "MOECOMP_W4_DECODE",
                "MOECOMP_W4_GEMV"):
        monkeypatch.delenv(var, raising=False)
    tuning._table.cache_clear()
    yield monkeypatch
    tuning._table.cache_clear()


def check_quant4_entry(cfg: dict, where: str) -> None:
    """A 4-bit table entry the launchers take: aligned tiles, a K-step form, top_k, a decode entry whose mode names
    its kernels and whose tiles are the GEMV launchers' keys."""
    keys = {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
    assert cfg["BLOCK_M"] in (16, 32, 64, 128) and cfg["top_k"] >= 1, where
    assert set(cfg["g1"]) == keys and set(cfg["g2"]) == keys, where
    assert cfg["w4_form"] in triton_quant4.FORMS and cfg.get("w4_fold", 0) in (0, 1), where
    dec = cfg["decode"]
    assert dec["max_t"] >= 0, where
    if dec["max_t"]:
        assert dec["mode"] in triton_quant4_gemv.MODES and set(dec["g1"]) == keys, where
        assert set(dec["g2"]) == keys | {"mode"} and dec["g2"]["mode"] in ("fused", "pairs"), where
        if dec["mode"] == "gemv":
            assert set(dec["gemv1"]) == set(dec["gemv2"]) == set(triton_quant4_gemv.TILE_KEYS), where


def _count(monkeypatch) -> dict:
    """Calls of the aligned path (align), the GEMV decode kernels and the DIRECT dot decode (decode_down)."""
    calls = {"align": 0, "gemv": 0, "dot": 0}
    for mod, fn, tag in ((triton_moe, "align", "align"), (triton_quant4_gemv, "gemm1", "gemv"),
                         (triton_moe, "decode_down", "dot")):
        real = getattr(mod, fn)

        def counted(*a, _real=real, _tag=tag, **kw):
            calls[_tag] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(mod, fn, counted)
    return calls


# ------------------------------------------------------------------------------------------------ the interpreted tune
@interpreted
@pytest.mark.parametrize("quant", [MXFP4, INT4], ids=["mxfp4", "int4_g128_zp"])
def test_entry_is_read_back_and_the_op_matches_the_reference(tuned, lookup, poison, quant):
    table, meta = _load(tuned), _load(tuned.parent / "cpu.meta.json")
    entry, rec = table[_key(quant)]["1"], meta[_key(quant)]["1"]
    assert set(table[_key(quant)]) == {"1"}
    check_quant4_entry(entry, "interpreted tune")
    assert entry["top_k"] == K and entry["w4_form"] in ("interleave", "split")  # the interpreter's two forms
    tiles = {w: {t[0] for t in tune_quant4.INTERPRET_TILES[w]} for w in ("g1", "g2")}
    assert entry["g1"]["BLOCK_N"] in tiles["g1"] and entry["g2"]["BLOCK_N"] in tiles["g2"]
    assert set(rec["form_ms"]) == {"interleave", "split"} and rec["quant4"] == tuning.quant4_key(quant)
    assert rec["ms"] == pytest.approx(rec["align_ms"] + rec["g1_ms"] + rec["g2_ms"])
    assert max(rec["err"]) <= tune_quant4.REL_TOL and rec["interpret"] is True and rec["seconds"] > 0
    measured = [int(t) for t in rec["decode_ms"]]
    assert measured and measured == [1, 2, 4, 8][:len(measured)], "probes in order, stopping at the first loss"
    dec = entry["decode"]
    assert dec["max_t"] in [0] + measured
    dev = torch.device("cpu")
    for T in (1, 5, 100):  # bucket 1 is the smallest and the only one: every T reads it
        assert tuning.quant4_config(E, I, H, T, K, dev, quant) == entry
    spec = interpret_spec(quant)
    for T in sorted({1, max(1, dec["max_t"]), dec["max_t"] + 1}):
        calls = _count(lookup)
        x, named = packed_layer(spec, T, torch.float32, dev, seed=100 + T)
        args, scales = tuple(named[n] for n in MOE_ARGS), scale_args(named)
        out = torch.ops.moecomp.moe_forward(x, *args, spec.key, **scales)
        ref = reference.moe_forward(x, *args, spec, **scales)
        err = tune_quant4.rel_err(out, ref)
        assert err < TOL, f"T={T}: rel err {err:.2e}"
        if T <= dec["max_t"]:  # the decode kernels the entry names, no alignment
            assert calls["align"] == 0 and calls[dec["mode"]] == 1 and calls["gemv" if dec["mode"] == "dot" else
                                                                               "dot"] == 0, (T, calls)
        else:
            assert calls == {"align": 1, "gemv": 0, "dot": 0}, (T, calls)


@interpreted
def test_budget_then_a_rerun_skips_finished_entries(tuned, tmp_path, monkeypatch, capsys):
    out, copy = tmp_path / "cpu.json", tmp_path / "copy"
    for name in ("cpu.json", "cpu.meta.json"):
        shutil.copyfile(tuned.parent / name, tmp_path / name)
    before, meta_before = _load(out), _load(tmp_path / "cpu.meta.json")
    calls = []
    monkeypatch.setattr(tune_io, "bench", lambda fn, rep_ms, device: calls.append(fn) or 1.0)
    args = ["--interpret", "--quant4", "mxfp4", "--out", str(out)]
    # bucket 1 is there: skipped; 64 is measured (one entry per run at least), then the budget stops before 128
    assert tune.main([*args, "--tokens", "1,64,128", "--budget-s", "0", "--copy-to", str(copy)]) == EXIT_BUDGET
    err = capsys.readouterr().err
    assert "skipping 1/3 entries" in err and "1 entries left" in err and calls
    table, meta = _load(out), _load(tmp_path / "cpu.meta.json")
    mx = _key(MXFP4)
    assert set(table[mx]) == {"1", "64"} and table[mx]["1"] == before[mx]["1"]
    assert table[_key(INT4)] == before[_key(INT4)] and meta[mx]["1"] == meta_before[mx]["1"]
    assert table[mx]["64"]["decode"] == {"max_t": 0} and "decode_ms" not in meta[mx]["64"]  # no decode from 64 on
    check_quant4_entry(table[mx]["64"], "bucket 64")
    assert _load(copy / "cpu.json") == table and _load(copy / "cpu.meta.json") == meta
    calls.clear()
    assert tune.main([*args, "--tokens", "1,64"]) == 0  # everything there: nothing measured, nothing written
    assert calls == [] and "all entries skipped" in capsys.readouterr().err and _load(out) == table


@interpreted
def test_decode_mode_and_limit_follow_the_timings(tmp_path, monkeypatch, poison):
    """The decode entry's mode is the faster decode kernel set at the bucket's T, its max_t the last probe before
    the first one the aligned path wins (the candidates really run and are checked; the routed steps' timings are
    made up); the op given a "gemv" entry runs the GEMV kernels up to its max_t and matches the reference."""
    from moecomp.cli.tune_quant4_decode import INTERPRET_DECODE_TILES, tune_decode

    spec, dev = interpret_spec(MXFP4), torch.device("cpu")
    x_all, named = packed_layer(spec, 8, torch.float32, dev, seed=1)
    aligned = dict(BLOCK_M=16, g1=tune_quant4.tile_config((16, 32, 4, 1), 16),
                   g2=tune_quant4.tile_config((16, 32, 4, 1), 16), w4_form="interleave")
    real, fake = tune_quant4.Run.measure, {}

    def measure(self, key, fn, ref, label, rows=None):
        r = real(self, key, fn, ref, label, rows)
        return (fake[key[1]](key[2]), r[1]) if r is not None and key[0] == "routed" else r

    monkeypatch.setattr(tune_quant4.Run, "measure", measure)
    monkeypatch.setattr(tune_io, "bench", lambda fn, rep_ms, device: 1.0)
    run = tune_quant4.Run(dev, 1, lambda text: None, lambda text: None)  # (its memo: each candidate runs once)
    cases = [({"gemv": lambda T: 1.0 * T, "dot": lambda T: 2.0 * T, "aligned": lambda T: 3 + 0.5 * T}, "gemv", 4,
              [{"gemv", "dot", "aligned"}, {"gemv", "aligned"}, {"gemv", "aligned"}, {"gemv", "aligned"}]),
             ({"gemv": lambda T: 1.0 * T, "dot": lambda T: 0.5 * T, "aligned": lambda T: 3 + 0.5 * T}, "dot", 8,
              [{"gemv", "dot", "aligned"}] + [{"dot", "aligned"}] * 3),
             ({"gemv": lambda T: 1.0 * T, "dot": lambda T: 2.0 * T, "aligned": lambda T: 0.1}, "gemv", 0,
              [{"gemv", "dot", "aligned"}])]
    for times, mode, max_t, timed in cases:
        fake.update(times)
        d = tune_decode(spec, [1, 2, 4, 8], x_all, named, aligned, run, INTERPRET_DECODE_TILES)
        assert (d["decode"]["mode"], d["decode"]["max_t"]) == (mode, max_t)
        assert [set(m) for m in d["ms"].values()] == timed and list(d["ms"]) == ["1", "2", "4", "8"][:len(timed)]
    entry = dict(aligned, decode=dict(d["decode"], max_t=4), top_k=K)
    assert entry["decode"]["mode"] == "gemv" and set(entry["decode"]["gemv1"]) == set(triton_quant4_gemv.TILE_KEYS)
    check_quant4_entry(entry, "made-up timings")
    (tmp_path / "cpu.json").write_text(json.dumps({_key(MXFP4): {"1": entry}}))
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    tuning._table.cache_clear()
    try:
        for T, path in ((3, "gemv"), (5, "align")):
            calls = _count(monkeypatch)
            x = x_all[:T].contiguous()
            args, scales = tuple(named[n] for n in MOE_ARGS), scale_args(named)
            err = tune_quant4.rel_err(torch.ops.moecomp.moe_forward(x, *args, spec.key, **scales),
                                      reference.moe_forward(x, *args, spec, **scales))
            assert err < TOL and calls[path] == 1 and sum(calls.values()) == 1, (T, calls, err)
    finally:
        tuning._table.cache_clear()


@interpreted
@pytest.mark.parametrize("quant", [MXFP4, INT4], ids=["mxfp4", "int4_g128_zp"])
def test_a_table_entry_sets_what_the_op_launches_and_none_falls_back(tmp_path, monkeypatch, poison, quant):
    """The op reads the 4-bit table at dispatch: with an entry (tiles, BLOCK_M and form unlike the heuristic's) its
    aligned GEMMs launch at the entry's BLOCK_M, tiles and K-step form; with no entry (an empty table directory) at
    the heuristic's (``quant4_config``'s fallback). Both equal the oracle."""
    spec, dev, T = interpret_spec(quant), torch.device("cpu"), 9  # above the CPU decode limit (8): aligned
    heur = tuning.quant4_config(E, I, H, T, K, dev, quant)  # (CONFIG_DIR has no "cpu" table)
    assert "g1" in heur and heur["BLOCK_M"] == 16 and (heur.get("w4_form") or "interleave") == "interleave"
    g1 = dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=1)
    g2 = dict(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=1)
    entry = dict(BLOCK_M=32, g1=g1, g2=g2, w4_form="split", decode={"max_t": 0}, top_k=K)
    assert (entry["g1"], entry["g2"]) != (heur["g1"], heur["g2"])
    check_quant4_entry(entry, "hand-made")
    with_entry, empty = tmp_path / "t", tmp_path / "empty"
    with_entry.mkdir(), empty.mkdir()
    (with_entry / "cpu.json").write_text(json.dumps({_key(quant): {"1": entry}}))
    for var in ("MOECOMP_CONFIG", "MOECOMP_DECODE_MAX_T", "MOECOMP_W4_FORM", "MOECOMP_W4_FOLD", "MOECOMP_TABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MOECOMP_CPU_BACKEND", "triton")
    launched = []
    for name in ("gemm1", "gemm2"):
        real = getattr(triton_moe, name)

        def spy(*a, _real=real, _name=name, **kw):  # gemm1(x, w13, b13, spec, aligned, k, bm, c1, q, ...)
            bm, c, q = (a[6], a[7], a[8]) if _name == "gemm1" else (a[7], a[8], a[9])
            launched.append((_name, bm, dict(c), q.get("W4_FORM", 0)))
            return _real(*a, **kw)

        monkeypatch.setattr(triton_moe, name, spy)
    x, named = packed_layer(spec, T, torch.float32, dev, seed=11)
    args, scales = tuple(named[n] for n in MOE_ARGS), scale_args(named)
    ref = reference.moe_forward(x, *args, spec, **scales)
    q1, q2 = triton_moe.expert_quant(named, spec, entry, T)
    try:
        for where, cfg in ((with_entry, entry), (empty, heur)):
            monkeypatch.setattr(tuning, "CONFIG_DIR", where)
            tuning._table.cache_clear()
            assert tuning.quant4_config(E, I, H, T, K, dev, quant) == cfg
            launched.clear()
            out = torch.ops.moecomp.moe_forward(x, *args, spec.key, **scales)
            assert tune_quant4.rel_err(out, ref) < TOL, where.name
            form = triton_quant4.FORMS[cfg.get("w4_form") or "interleave"]
            want = [("gemm1", cfg["BLOCK_M"], cfg["g1"], form), ("gemm2", cfg["BLOCK_M"], cfg["g2"], form)]
            assert launched == want, (where.name, launched)
            assert (q1["W4_FORM"], q2["W4_FORM"]) == (triton_quant4.FORMS["split"],) * 2
    finally:
        tuning._table.cache_clear()


# ------------------------------------------------------------------------------------------------ parts
def test_wrong_candidates_are_rejected_and_failing_ones_skipped(monkeypatch):
    monkeypatch.setattr(tune_io, "bench", lambda fn, rep_ms, device: 2.5)
    notes = []
    run = tune_quant4.Run(torch.device("cpu"), 1, lambda text: None, notes.append)
    ref = torch.linspace(1, 2, 8)
    assert run.measure("off", lambda: ref * (1 + 2 * tune_quant4.REL_TOL), ref, "off by 2 REL_TOL") is None
    assert run.measure("nan", lambda: torch.where(ref > 1.5, float("nan"), ref), ref, "nan") is None
    assert run.measure("raises", lambda: 1 / 0, ref, "raises") is None
    assert (run.rejected, run.failed) == (2, 1) and "REJECT off by 2 REL_TOL" in notes[0] and "skip raises" in notes[2]
    rows = torch.arange(8) < 4  # only these rows are compared (the rest: padding a kernel never writes)
    assert run.measure("rows", lambda: torch.cat([ref[:4], torch.full((4,), float("nan"))]), ref[:4], "rows",
                       rows) == (2.5, 0.0)
    assert run.measure("off", lambda: ref, ref, "memo") is None  # measured once per key


@pytest.mark.parametrize("quant", [MXFP4, INT4, QuantSpec.int4(32)], ids=["mxfp4", "int4_g128_zp", "int4_g32"])
@pytest.mark.parametrize("gated", ["interleaved", "concat"])
def test_pair_reference_is_the_oracles_arithmetic(quant, gated):
    spec = interpret_spec(quant) if gated == "interleaved" else MoESpec(
        num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant=quant)
    T = 5
    x, named = packed_layer(spec, T, torch.float32, torch.device("cpu"), seed=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.argsort(torch.rand(T, E, generator=g), 1)[:, :K]
    w = torch.rand(T, K, generator=g)
    h, y = pair_reference(x, ids, w, named, spec)
    want = reference.experts(x, ids, w, named["w13"], named["b13"], named["w2"], named["b2"], spec,
                             **scale_args(named))
    assert h.shape == (T * K, I) and tune_quant4.rel_err(y.view(T, K, H).sum(1), want) < 1e-6


@pytest.mark.parametrize("name", sorted(tune_quant4.QUANT4_PRESETS))
def test_packed_layer_is_made_packed(name):
    """The random layer holds the spec's packed tensors (codes, scales, zero points) and no float tensor the size of
    an expert matrix (checked at a preset's shapes, one expert: the meta device would hide nothing)."""
    spec = tune_quant4.QUANT4_PRESETS[name]
    spec = spec.replace(num_experts=1, top_k=1)
    x, named = packed_layer(spec, 2, torch.bfloat16, torch.device("cpu"), seed=0)
    shapes, qshapes = spec.expert_weight_shapes(), spec.quant_shapes()
    assert named["w13"].dtype == named["w2"].dtype == torch.uint8
    assert named["w13"].shape == shapes["w13"] and named["w2"].shape == shapes["w2"]
    for s in ("w13_scale", "w2_scale"):
        assert named[s].shape == qshapes[s]
    if spec.quant.zero_point:
        assert named["w13_zero"].dtype == torch.uint8 and int(named["w13_zero"].max()) <= 15
    smallest = min(spec.hidden_size, spec.intermediate_size) ** 2
    assert all(t.numel() < smallest for t in named.values() if torch.is_tensor(t) and t.is_floating_point())


def test_gpt_oss_presets_follow_gpt_oss_config():
    pytest.importorskip("transformers")
    from moecomp.testing.mxfp4_write import gpt_oss_config

    for size, n_exp in (("120b", 128), ("20b", 32)):
        cfg, spec = gpt_oss_config(size), tune_quant4.QUANT4_PRESETS[f"gpt_oss_{size}"]
        assert (spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k) == (
            cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok)
        assert spec.num_experts == n_exp and spec.activation_limit == getattr(cfg, "swiglu_limit", 7.0)
        assert spec.quant == MXFP4 and spec.has_expert_bias and spec.gate_up == "interleaved"


def test_formats_and_presets_from_the_command_line():
    assert tune_quant4.parse_formats("both") == (MXFP4, INT4)
    assert tune_quant4.parse_formats("int4_g32") == (QuantSpec.int4(32),)
    assert tuning.quant4_key(tune_quant4.parse_formats("int4_g64_zp")[0]) == "int4_g64_zp"
    for bad in ("fp4", "int4_g48", "int4_g0_zp"):
        with pytest.raises(SystemExit):  # argparse's error for the --quant4 value
            tune.arg_parser().parse_args(["--quant4", bad])
    with pytest.raises(SystemExit, match="is mxfp4"):  # a preset in a format its checkpoints do not ship in
        tune.main(["--interpret", "--quant4", "int4", "--presets", "gpt_oss_20b", "--out", "/nonexistent/x.json"])
    with pytest.raises(SystemExit, match="unknown 4-bit preset"):
        tune.main(["--interpret", "--quant4", "mxfp4", "--presets", "mixtral_8x7b", "--out", "/nonexistent/x.json"])
    with pytest.raises(SystemExit, match="one kind of experts"):
        tune.main(["--interpret", "--quant4", "mxfp4", "--fp8", "both", "--out", "/nonexistent/x.json"])


@pytest.mark.parametrize("quant", [MXFP4, INT4], ids=["mxfp4", "int4_g128_zp"])
def test_candidates_hold_the_heuristics_tiles(quant):
    """At the static heuristic's BLOCK_M (a candidate), its tiles are among the tile candidates: a tuned entry is no
    slower than the heuristic, but for timing noise. The same for the DIRECT decode tiles."""
    from moecomp.cli.tune_quant4_decode import Q4_DECODE_TILES

    for E_, k in ((128, 4), (128, 8), (8, 2)):
        for T in (1, 16, 128, 1024, 8192):
            h = tuning._quant4_heuristic(T, k, E_, quant)
            assert h["BLOCK_M"] in tune_quant4.block_ms(T, k, E_)
            for w in ("g1", "g2"):
                c = h[w]
                assert (c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]) in tune_quant4.tiles_at(
                    tune_quant4.Q4_TILES[w], h["BLOCK_M"]), (E_, k, T, w, c)
    dec = tuning._decode_heuristic(torch.device("cuda"))
    assert (32, 128, 4, 4) == tuple(dec["g1"][n] for n in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
    assert (32, 128, 4, 4) in Q4_DECODE_TILES["g1"] and (64, 128, 4, 3, "pairs") in Q4_DECODE_TILES["g2"]


def test_decode_probes_and_gemv_candidates():
    from moecomp.cli.tune_quant4_decode import decode_probes, gemv_candidates

    assert decode_probes(1, [1, 16, 128]) == [1, 2, 4, 8] and decode_probes(16, [1, 16]) == [16, 32, 64]
    assert decode_probes(64, [1, 64]) == []
    base = dict(BLOCK_N=32, BLOCK_K=128, REDUCE_END=1, PREFETCH=1, num_warps=4, num_stages=3)
    c = gemv_candidates(base, interpret=False)
    assert c[0] == base and len(c) == 8 and all(sum(x[k] != base[k] for k in base) == 1 for x in c[1:])
    assert gemv_candidates(base, interpret=True) == [base, dict(base, BLOCK_N=64)]


@pytest.mark.parametrize("path", sorted(p.name for p in tuning.CONFIG_DIR.glob("*.json") if ".meta." not in p.name))
def test_shipped_quant4_entries_are_well_formed(path):
    table = json.loads((tuning.CONFIG_DIR / path).read_text())
    for shape, buckets in table.items():
        if shape.endswith(("dtype=mxfp4", "_zp")) or "dtype=int4_g" in shape:
            for bucket, cfg in buckets.items():
                check_quant4_entry(cfg, f"{path} {shape} bucket {bucket}")


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("quant", [MXFP4, INT4], ids=["mxfp4", "int4_g128_zp"])
def test_gpu_tune_small_4bit_layer(tmp_path, monkeypatch, quant):
    """A real tune of a small 4-bit layer (both paths, every candidate), read back; the op with it against the
    dequantized reference at T = 1 (decode) and 128 (aligned)."""
    dev = torch.device("cuda")
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning._table.cache_clear()
    out = tmp_path / f"{tuning.device_key(dev)}.json"
    fmt = "mxfp4" if quant == MXFP4 else "int4"
    assert tune.main(["--quant4", fmt, "--shape", "8,256,512,2", "--tokens", "1,128", "--rep", "5",
                      "--out", str(out)]) == 0
    table = _load(out)[_key(quant, 8, 256, 512)]
    assert set(table) == {"1", "128"}
    spec = MoESpec(num_experts=8, top_k=2, hidden_size=512, intermediate_size=256, quant=quant)
    try:
        for T, bucket in ((1, "1"), (128, "128")):
            check_quant4_entry(table[bucket], bucket)
            assert tuning.quant4_config(8, 256, 512, T, 2, dev, quant) == table[bucket]
            x, named = packed_layer(spec, T, torch.bfloat16, dev, seed=7)
            args, scales = tuple(named[n] for n in MOE_ARGS), scale_args(named)
            got = torch.ops.moecomp.moe_forward(x, *args, spec.key, **scales)
            err = tune_quant4.rel_err(got, reference.moe_forward(x, *args, spec, **scales))
            assert err < TOL_GPU, f"T={T}: rel err {err:.2e}"
    finally:
        tuning._table.cache_clear()
