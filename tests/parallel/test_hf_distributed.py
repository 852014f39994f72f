"""transformers' own distributed loading, then ``moecomp.optimize`` (``moecomp/api/hf_distributed.py``,
``moecomp/hf/ep_interface.py``): tiny models saved to a temp dir, loaded by ``from_pretrained(path,
distributed_config=...)`` in 2 gloo processes on 127.0.0.1 (``gloo_run.py``), as torchrun would run them. Every plan
style transformers 5.24 / 5.25 has:

* EP plan (``DistributedConfig(tp_size=2, ep_size=2)``, attention TP): experts DTensors Shard(0), with
  ``ep_implementation`` "all_reduce" (DeepSeek-V3: its shared expert TP-sliced), "all_to_all" (Qwen3-MoE) and
  "moecomp" (Qwen3-MoE: transformers' EP dispatch on moecomp's parallel experts path): mode "ep", dispatch
  "all_reduce" (the two ranks share one batch);
* the default TP plan (``DistributedConfig(tp_size=2)``), whatever the installed version's plan shards, expected from
  that plan: DeepSeek-V3 (groups, correction bias, a shared expert): 5.24 splits the routed experts (mode "tp"), 5.25
  leaves them whole and splits the shared expert and attention (mode "replicated"); Qwen3-MoE: 5.24 "tp", 5.25 nothing
  in the block (the ordinary path, no parallel part) with attention TP around it;
* the routed experts split by an explicit TP plan (``packed_colwise`` / ``rowwise`` / ``moe_tp_experts``: 5.24's
  default, deprecated in 5.25), DeepSeek-V3: mode "tp" with the shared expert's slice;
* a TP plan that shards gate_up_proj otherwise (plain "colwise"): refused on every rank, naming both layouts.

Each bound job: ``scan`` / ``optimize`` report exactly the 2 MoE blocks supported / rewritten (then "already"); every
parameter of the blocks is the loaded local tensor (the same storage, no DTensor left, nothing copied); the DTensors
outside the blocks (TP attention) are untouched; each block's output on fresh random inputs equals the single-process
HF block's, the logits the single-process model's (fp32: relative Frobenius error < ``TOL`` = 2e-5, summation order
only); every uninitialised output buffer is NaN-poisoned (``torch.use_deterministic_algorithms`` with
``fill_uninitialized_memory``: an element the path forgot to write shows); greedy ``generate()`` tokens (transformers'
loop, and moecomp's engine on CPU) equal the single-process tokens, on every rank (``GENERATE`` jobs; the others check
the logits only, for time).

transformers 5.24 / 5.25 ask for ``accelerate`` whenever a device map is set, and the distributed loader sets one (the
CPU) even on CPU; the load itself uses nothing of accelerate. Without accelerate installed, the workers lift that check
(``_accelerate_check_lifted``) for the loads only. transformers without ``transformers.distributed`` (5.17): the gloo
tests skip, naming why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: generate.models
import gloo_run  # noqa: E402

from moecomp.hf import ep_interface as hf_ep  # noqa: E402

TOL = 2e-5
WHY_NOT = hf_ep.available()
JOBS = ("tfd_deepseek_ep_all_reduce", "tfd_qwen3_ep_all_to_all", "tfd_moecomp_ep", "tfd_deepseek_tp_default",
        "tfd_qwen3_tp_default", "tfd_deepseek_tp_experts", "tfd_other_layout")
EXPERTS_TP = {  # the routed experts split by their intermediate columns (5.24's default rules; deprecated in 5.25)
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise", "model.layers.*.mlp.experts.down_proj": "rowwise",
    "model.layers.*.mlp.experts": "moe_tp_experts"}


# ------------------------------------------------------------------------------------------------ in the workers
@contextlib.contextmanager
def _accelerate_check_lifted():
    """transformers' "requires accelerate" check of a device map, lifted where accelerate is not installed (the
    module docstring says why)."""
    if importlib.util.find_spec("accelerate") is not None:
        yield
        return
    import transformers.integrations.accelerate as acc

    before = acc.is_accelerate_available
    acc.is_accelerate_available = lambda *a, **k: True
    try:
        yield
    finally:
        acc.is_accelerate_available = before


def _saved(rank: int, family: str):
    """(the single-process model, a temp dir it is saved in by rank 0, shared by every rank)."""
    import tempfile

    from generate.models import build

    ref = build(family, layers=2, seed=0)
    box = [None]
    if rank == 0:
        box[0] = tempfile.mkdtemp(prefix=f"moecomp_tfd_{family}_")
        ref.save_pretrained(box[0])
    dist.broadcast_object_list(box, src=0)
    return ref, box[0]


def _load(path: str, **config):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    with _accelerate_check_lifted():
        return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**config),
                                                    dtype=torch.float32).eval()


def _same_on_every_rank(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(g, t) for g in got)


def _blocks(model) -> list:
    return [m for n, m in model.named_modules() if n.endswith(".mlp")]


def _is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "to_local")


def _local_storage(model) -> tuple[list, dict]:
    """([{parameter name: (data_ptr of what this rank holds, its shape)} per block], {DTensor parameter outside the
    blocks: its placements})."""
    blocks = [{n: ((p.to_local() if _is_dtensor(p) else p).data_ptr(), tuple((p.to_local() if _is_dtensor(p) else
                                                                            p).shape))
               for n, p in b.named_parameters()} for b in _blocks(model)]
    inside = {id(p) for b in _blocks(model) for p in b.parameters()}
    outside = {n: tuple(p.placements) for n, p in model.named_parameters() if _is_dtensor(p) and id(p) not in inside}
    return blocks, outside


def _expected_tp(ref) -> str | None:
    """The mode a default TP plan gives, read from that plan (not from the loaded tensors, which the loader reads):
    "tp" where it splits the routed experts, "replicated" where it splits the shared experts only, None (the ordinary
    path) where it splits nothing in the block."""
    plan = ref.tp_plan
    if any(k.endswith("mlp.experts.gate_up_proj") for k in plan):
        return "tp"
    return "replicated" if any(".mlp.shared_expert" in k for k in plan) else None


def _bind(model, rank: int, W: int, name: str, expect, use_capture: bool) -> None:
    """scan, optimize, scan again: exactly the 2 blocks; each bound with the expected parallel part (None: the
    ordinary op) on the loaded tensors (the same storage, plain Parameters); the DTensors outside the blocks as
    loaded."""
    import moecomp

    before, outside = _local_storage(model)
    scanned = moecomp.scan(model, use_capture=use_capture)  # (verifies, binds nothing)
    assert [b.status for b in scanned.blocks] == ["supported"] * 2, scanned
    model, rep = moecomp.optimize(model, use_capture=use_capture, report=True)
    assert [b.status for b in rep.blocks] == ["rewritten"] * 2, rep
    again = moecomp.scan(model, use_capture=False)
    assert [b.status for b in again.blocks] == ["already"] * 2, again
    after, outside_after = _local_storage(model)
    assert after == before and outside_after == outside, name  # nothing copied, nothing outside the blocks changed
    mode, dispatch = expect if isinstance(expect, tuple) else (expect, "all_reduce")
    for b in _blocks(model):
        p = b._moecomp.op_spec.parallel
        assert (p if mode is None else (p.mode, p.world_size, p.rank, p.dispatch)) == (
            None if mode is None else (mode, W, rank, dispatch)), (name, p)
        assert all(type(t) is torch.nn.Parameter for t in b.parameters()), name


def _check(rank: int, W: int, family: str, config: dict, expect=None, before=None, use_capture: bool = False,
           generate: bool = True) -> list:
    """Load ``family`` with ``config``, optimize, compare with the single-process model (module docstring).
    ``expect``: the parallel mode the blocks get (None: the ordinary op; a callable: of the single-process model);
    ``use_capture``: optimize's default (the FX pass installed; a sharded block is read by the attribute reader all
    the same), else without it (faster)."""
    from moecomp.testing import rel_err
    from generate.models import prompts

    ref, path = _saved(rank, family)
    expect = expect(ref) if callable(expect) else expect
    name = f"{family}/{expect}"
    rows = []
    try:
        model = _load(path, **config)
        ids, mask = prompts(96, 2, 5, seed=1, left_pad=(0, 2))
        with torch.no_grad():
            want = ref(ids, attention_mask=mask).logits
        if before is not None:
            rows += before(model, ref, ids, mask, want, rank)
        _bind(model, rank, W, name, expect, use_capture)
        g = torch.Generator().manual_seed(2)  # the same inputs on every rank (the group shares one batch)
        with torch.no_grad():
            for i, (b, rb) in enumerate(zip(_blocks(model), _blocks(ref))):
                x = torch.randn(3, 7, ref.config.hidden_size, generator=g)
                calls = b._moecomp.calls
                got = b(x)
                assert b._moecomp.calls == calls + 1  # the bound op ran (not transformers' sharded forward)
                rows.append((f"{name} block {i}", rank, rel_err(got, rb(x)), TOL))
            rows.append((f"{name} logits", rank, rel_err(model(ids, attention_mask=mask).logits, want), TOL))
        if generate:
            rows += _generate(model, ref, ids, mask, rank, name)
    finally:
        dist.barrier()
        if rank == 0:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    return rows


def _generate(model, ref, ids, mask, rank: int, name: str) -> list:
    """Greedy tokens of transformers' loop and of moecomp's engine (CPU: static cache, eager steps): the same on
    every rank and as the single-process model's."""
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    rows, gen = [], model.generate
    for engine in (False, True):
        gen.cpu = engine
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert gen.last["path"] == ("moecomp" if engine else "transformers"), gen.last
        assert _same_on_every_rank(tokens), f"{name}: ranks generated different tokens"
        rows.append((f"{name} generate{' engine' if engine else ''}", rank, float((tokens != want).sum()), 0.5))
    return rows


@contextlib.contextmanager
def _poisoned():
    """Every uninitialised output buffer (torch.empty / empty_like) NaN-filled while checking."""
    import torch.utils.deterministic as det

    was, fill = torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        det.fill_uninitialized_memory = fill


def tfd_deepseek_ep_all_reduce(rank: int, W: int, comm=None) -> list:
    """The routed experts split by experts (the EP mesh), the shared expert by its I (the TP plan, the same ranks):
    both summed in the op's one all-reduce."""
    with _poisoned():
        return _check(rank, W, "deepseek_v3", dict(tp_size=W, ep_size=W, ep_implementation="all_reduce"), "ep")


def tfd_qwen3_ep_all_to_all(rank: int, W: int, comm=None) -> list:
    """transformers' all-to-all dispatch (each rank its slice of the shared batch, exchanged, gathered back): moecomp
    binds the same expert shards; its dispatch all-reduces over the batch the group shares."""
    with _poisoned():
        return _check(rank, W, "qwen3_moe", dict(tp_size=W, ep_size=W, ep_implementation="all_to_all"), "ep",
                      generate=False)


def tfd_deepseek_tp_default(rank: int, W: int, comm=None) -> list:
    with _poisoned():
        return _check(rank, W, "deepseek_v3", dict(tp_size=W), _expected_tp)


def tfd_qwen3_tp_default(rank: int, W: int, comm=None) -> list:
    with _poisoned():
        return _check(rank, W, "qwen3_moe", dict(tp_size=W), _expected_tp, generate=False)


def tfd_deepseek_tp_experts(rank: int, W: int, comm=None) -> list:
    with _poisoned():  # (5.25 logs that these rules are deprecated, and applies them)
        return _check(rank, W, "deepseek_v3", dict(tp_size=W, tp_plan=dict(EXPERTS_TP)), "tp", generate=False)


def _moecomp_dispatch(model, ref, ids, mask, want, rank) -> list:
    """Before optimize: transformers' EP dispatch is moecomp's (MoecompEP, no fallback warning) and the logits are
    the single-process model's; with gradients needed, transformers' own dispatch runs instead (one warning)."""
    from moecomp.testing import rel_err

    experts = [b.experts for b in _blocks(model)]
    impls = [c.cell_contents for e in experts for c in e.forward.__closure__ or ()
             if type(c.cell_contents).__name__ == "MoecompEP"]
    assert len(impls) == len(experts), "ep_implementation='moecomp' did not install MoecompEP"
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        got = model(ids, attention_mask=mask).logits
    assert not [w for w in seen if "moecomp EP implementation" in str(w.message)], [str(w.message) for w in seen]
    assert all(e.__dict__.get("_moecomp_experts_specs") for e in experts)  # MoecompEP read its spec: it ran
    with warnings.catch_warnings(record=True) as seen:  # grad mode on, weights requiring grad: transformers' "auto"
        warnings.simplefilter("always")
        fallback = model(ids, attention_mask=mask).logits.detach()
    assert any("gradients needed" in str(w.message) for w in seen), [str(w.message) for w in seen]
    return [("qwen3_moe/moecomp EP dispatch logits", rank, rel_err(got, want), TOL),
            ("qwen3_moe/moecomp EP dispatch, fallback with gradients", rank, rel_err(fallback, want), TOL)]


def tfd_moecomp_ep(rank: int, W: int, comm=None) -> list:
    with _poisoned():
        return _check(rank, W, "qwen3_moe", dict(tp_size=W, ep_size=W, ep_implementation="moecomp"), "ep",
                      before=_moecomp_dispatch, use_capture=True)


def tfd_other_layout(rank: int, W: int, comm=None) -> list:
    """Layouts that are not moecomp's, refused by optimize on every rank, naming the tensors and the layouts, binding
    nothing (the ranks agree; no collective is left waiting):
    * gate_up_proj sharded by plain rows ("colwise": rank 0 all gate rows, rank 1 all up rows) where moecomp's TP
      shard is gate[s] | up[s] (down_proj by columns, the experts' output all-reduced, as 5.24's default plan);
    * gate_up_proj sharded, down_proj whole (seen before anything runs: transformers' own forward of such experts
      fails on mixed tensors and DTensors in 5.25)."""
    import moecomp

    _, path = _saved(rank, "qwen3_moe")
    gate_up, down = "model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"
    held = "[0, 32)" if rank == 0 else "[32, 64)"
    want = f"[{16 * rank}, {16 * rank + 16}) + [{32 + 16 * rank}, {48 + 16 * rank})"
    cases = {  # plan -> what every block's reason must say
        "rows": ({**EXPERTS_TP, gate_up: "colwise"}, f"holds indices {held} of dim 1 (placements (Shard(dim=1),)), "
                 f"moecomp's tp {rank}/{W} I [{16 * rank}, {16 * rank + 16}) shard is {want}"),
        "half": ({gate_up: "colwise", down: "replicate"}, f"experts.gate_up_proj is a DTensor, placements "
                 f"(Shard(dim=1),): indices {held} of dim 1 on this rank but experts.down_proj is whole (a plain "
                 f"tensor): moecomp's layouts split the routed experts' tensors alike"),
    }
    try:
        for plan, reason in cases.values():
            model = _load(path, tp_size=W, tp_plan=plan)
            rep = moecomp.optimize(model, use_capture=False, report=True)[1]
            assert len(rep.blocks) == 2, rep
            for b in rep.blocks:
                assert b.status == "skipped" and reason in b.reason, (reason, b.reason)
            assert not any("_moecomp" in m.__dict__ for m in model.modules())
    finally:
        dist.barrier()
        if rank == 0:
            import shutil

            shutil.rmtree(path, ignore_errors=True)
    return [(f"qwen3_moe/other layout refused ({c})", rank, 0.0, 1.0) for c in cases]


def _worker(rank, W, port, jobs, out, timeout):
    """gloo_run's worker, with this module's jobs added to ``scenarios.JOBS`` in the worker."""
    import scenarios

    scenarios.JOBS.update({j: globals()[j] for j in JOBS})
    gloo_run._worker(rank, W, port, jobs, out, timeout)


# ------------------------------------------------------------------------------------------------ the tests
needs_tfd = pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "-")
# transformers' distributed loader puts the model on the accelerator it finds (torch._C._get_accelerator): these
# processes compare with a CPU model over gloo
needs_gloo = pytest.mark.skipif(torch.cuda.is_available() or not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo, and no CUDA device (transformers' loader "
                                       "would put the model on it)")


@pytest.fixture(scope="module")
def world():
    return gloo_run.run_world(2, JOBS, timeout=240, worker=_worker)


def _ok(rows, W=2):
    assert rows and {r[1] for r in rows} == set(range(W)), rows
    bad = [r for r in rows if not r[2] < r[3]]
    assert not bad, bad


@needs_gloo
@needs_tfd
@pytest.mark.parametrize("job", ["deepseek_ep_all_reduce", "qwen3_ep_all_to_all"])
def test_ep_plan_bound_to_the_parallel_op(world, job):
    _ok(world[f"tfd_{job}"])


@needs_gloo
@needs_tfd
@pytest.mark.parametrize("family", ["deepseek", "qwen3"])
def test_default_tp_plan(world, family):
    """Whatever the installed version's default plan shards: DeepSeek-V3's shared expert (and, in 5.24, its routed
    experts), Qwen3-MoE's routed experts (5.24) or nothing in the block (5.25)."""
    _ok(world[f"tfd_{family}_tp_default"])


@needs_gloo
@needs_tfd
def test_routed_experts_split_by_an_explicit_tp_plan(world):
    _ok(world["tfd_deepseek_tp_experts"])


@needs_gloo
@needs_tfd
def test_ep_implementation_moecomp(world):
    rows = world["tfd_moecomp_ep"]
    _ok(rows)
    assert any(r[0] == "qwen3_moe/moecomp EP dispatch logits" for r in rows)


@needs_gloo
@needs_tfd
def test_a_layout_that_is_not_moecomps_is_refused(world):
    _ok(world["tfd_other_layout"])


def test_reason_without_transformers_distributed(monkeypatch):
    """transformers without ``transformers.distributed.expert_parallel`` (5.17): nothing registered, and
    ``available()`` names the module and the version that has it."""
    monkeypatch.setitem(sys.modules, hf_ep.TARGET, None)  # (an import of it now fails, as where it does not exist)
    why = hf_ep.available()
    assert hf_ep.TARGET in why and "5.24" in why, why
    assert hf_ep.register() is False


@pytest.mark.parametrize("name, mode", [("deepseek_v3", "ep"), ("deepseek_v3", "tp"), ("deepseek_v3", "ep_a2a"),
                                        ("deepseek_v3", "replicated"), ("qwen2_gated_shared", "replicated"),
                                        ("latent", "replicated"), ("latent", "tp")])
def test_shared_experts_given_as_this_ranks_slice(name, mode):
    """The parallel op with the shared experts as each rank's slice of their I (how transformers' TP plan loads them:
    rows of gate / up, columns of down), emulated at W = 2 (threads), NaN-poisoned buffers: equal to the whole block
    (fp32, ``TOL``): summed in the routed part's all-reduce (EP all-reduce, TP), or on their own beside routed experts
    whole on every rank ("replicated", latent projections too); the paths that have no all-reduce to sum such slices
    in (all-to-all, a latent block's TP) refuse them naming shared_w2."""
    import scenarios as sc
    from moecomp import parallel as par
    from moecomp.core.spec import SpecError
    from moecomp.testing import rel_err

    W = 2
    x, t = sc.block(name, 6)
    ref = sc.oracle(x, t, sc.SPECS[name])
    n = sc.SPECS[name].shared.intermediate_size // W

    def run(rank, comm):
        spec = sc.parallel_spec(name, mode, W, rank)
        s = slice(rank * n, (rank + 1) * n)
        args = {**t, **par.shard_tensors(t, spec), "shared_w1": t["shared_w1"][s].clone(),
                "shared_w3": t["shared_w3"][s].clone(), "shared_w2": t["shared_w2"][:, s].contiguous()}
        return par.forward(x, args, spec, comm)

    with _poisoned():
        if mode == "ep_a2a" or (name, mode) == ("latent", "tp"):
            with pytest.raises(SpecError, match=r"shared_w2 has shape \(32, 12\): this rank's slice"):
                par.emulate(W, run)
            return
        outs = par.emulate(W, run)
    assert all(rel_err(o, ref) < TOL for o in outs), [rel_err(o, ref) for o in outs]


@needs_tfd
def test_registered_when_transformers_ep_is_imported():
    """A fresh ``import moecomp`` imports no transformers and arms a hook; importing transformers' expert_parallel
    then registers "moecomp" (a subclass of its EPImplementation) and leaves its own names alone."""
    import subprocess
    import textwrap

    code = textwrap.dedent("""
        import sys
        import moecomp
        from moecomp.hf import ep_interface as hf_ep
        assert "transformers" not in sys.modules and not hf_ep.REGISTERED and hf_ep._finder in sys.meta_path
        import transformers.distributed.expert_parallel as ep
        impls = ep.EPImplementationInterface()
        assert hf_ep.REGISTERED and hf_ep._finder not in sys.meta_path
        assert issubclass(impls["moecomp"], ep.EPImplementation) and impls["auto"] is ep.AutoEP
        print("ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
