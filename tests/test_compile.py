"""--compile none|model|blocks (docs/levers.md): graphs really captured, the same training, and the trap.

  capture + parity ....... launch/ddp.py (a group of one) with --compile model (on a GPT of 2 blocks) and
                           single.py with --compile blocks (the GPT's 4): dynamo captured graphs, with no graph
                           break, and 2 steps in the parity mode (64-true) end within 1e-9 of eager single.py
  the wrong order ........ torch.compile(DDP(model)) breaks the graph at DDP's forward: the breaks a test of the
                           right order asserts to be zero are there, so that check can fail (dynamo's count: with
                           backend="eager", whose graphs are not compiled by Inductor; the break is dynamo's)
  FSDP2 and pipeline ..... one 2-rank job: launch/zero.py --stage 2 and launch/pipeline.py with --compile blocks,
                           compiled after fully_shard / the split: graphs captured, no break, 2 steps within 1e-9
                           of eager single.py; the sharded root compiled as one graph (fullgraph) captures nothing
                           and raises. ~30 s with Inductor's cache warm, 65-75 s cold on the loaded 2-core machine
  summary.json ........... compile_s (the first step's excess over the steady rate) and steady_samples_per_s
  refusals ............... where it is not built (DataParallel, fairscale, ...), with checkpointing, blocks on mlp
Each compile costs 15-60 s on a 2-core CPU: the runs are 2 steps of the small GPT, evaluated on one batch.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from conftest import PARITY_TOL_64, gpt_blocks, load_model_state, make_cfg, max_param_diff
from manual_train.errors import UsageError

GPT = dict(model="gpt", dataset="reverse", synthetic_size=32, batch_size=16, max_steps=2, precision="64-true",
           limit_val_batches="1", eval_batch_size=16, log_every=1)


def _breaks() -> int:
    return sum(counters["graph_break"].values())


def _train(module, config_cls, tmp_path, name, **extra) -> tuple[dict, dict]:
    torch._dynamo.reset()
    counters.clear()
    summary = module.train(make_cfg(tmp_path / name, config_cls, **{**GPT, **extra}))
    return load_model_state(tmp_path / name / "run"), summary


@pytest.mark.slow
def test_compiled_gpt_captures_graphs_without_breaks_and_trains_as_eager(tmp_path, lone_process, monkeypatch):
    """The whole model (--compile model) is a GPT of 2 blocks, not 4: Inductor compiles the whole forward and backward
    block by block (2-core EPYC, 2026-12-06: 76 CPU s with 4 blocks, 49 with 2, C++ compiling most of it), and 2
    blocks keep what a whole-model graph has that one block's has not (the loop over the blocks, the residual stream
    between them). --compile blocks compiles each of the 4 (the same graph: Inductor's cache compiles it once)."""
    from manual_train.distributed import DDPConfig
    from manual_train.config import Config
    from manual_train.loops import ddp, single

    def compiled_as(eager: dict, name: str, module, config_cls, mode: str) -> None:
        state, summary = _train(module, config_cls, tmp_path, name, compile=mode)
        graphs, breaks = counters["stats"]["unique_graphs"], _breaks()
        print(f"{name}: {graphs} graphs, {breaks} graph breaks, max diff from eager {max_param_diff(eager, state):.3g}"
              f", compile_s {summary['compile_s']:.1f}, {summary['steady_samples_per_s']:.0f} samples/s")
        assert graphs > 0 and breaks == 0, dict(counters["graph_break"])
        assert max_param_diff(eager, state) <= PARITY_TOL_64
        assert summary["compile_s"] >= 0 and summary["steady_samples_per_s"] > 0  # (timings: reported, not held)

    eager, summary = _train(single, Config, tmp_path, "eager")
    assert counters["stats"]["unique_graphs"] == 0
    print(f"eager: compile_s {summary['compile_s']:.2f}, {summary['steady_samples_per_s']:.0f} samples/s")
    compiled_as(eager, "single_blocks", single, Config, "blocks")
    with monkeypatch.context() as patch:
        gpt_blocks(patch, 2)
        eager_2_blocks, _ = _train(single, Config, tmp_path, "eager_2_blocks")
        assert len(eager_2_blocks) < len(eager)  # (the 2-block GPT: fewer parameter tensors)
        compiled_as(eager_2_blocks, "ddp_model", ddp, DDPConfig, "model")


@pytest.mark.slow
def test_compiling_the_ddp_wrapper_breaks_the_graph(lone_process):
    """The order the loops do not use: dynamo stops at DDP's forward (its hooks and buckets are Python). Graph breaks
    are dynamo's: the same with any backend; backend="eager" runs the captured pieces as they are instead of compiling
    them with Inductor (a whole GPT at another batch size than the tests above: tens of seconds of C++ compiling)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from manual_train.models import DataInfo, build_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = torch.compile(DDP(build_model("gpt", DataInfo("reverse", (16,), 32, predict=8))), backend="eager")
        model(torch.randint(0, 32, (4, 16))).sum().backward()
        print(f"torch.compile(DDP(gpt)): {counters['stats']['unique_graphs']} graphs, {_breaks()} graph breaks")
        assert _breaks() > 0
    finally:
        dist.destroy_process_group()


def _sharded_scenario(name: str, world_size: int, rank: int, out) -> dict:
    """2 ranks, 2 steps of the GPT with --compile blocks: ZeRO-2 (each block compiled after its fully_shard) and the
    GPipe pipeline (each stage's blocks, after the split); and the order that cannot capture: the sharded root
    compiled as one graph (it calls the blocks' FSDP hooks). Each block sees 16 rows, as in the single-process
    test above: the same graphs, so Inductor's on-disk cache compiles them once for the whole file."""
    from manual_train.loops import pipeline, zero
    from manual_train.zero import ZeroConfig

    torch._dynamo.reset()
    counters.clear()
    if name == "whole_sharded_root":
        return _compile_sharded_root()
    if name == "pipeline":  # the baseline's batch of 32 in 2 micro-batches of 16
        summary = pipeline.train(make_cfg(out / name, pipeline.PipelineConfig, **{**GPT, "batch_size": 32},
                                          compile="blocks", microbatches=2))
    else:  # 16 per rank: the baseline's global batch of 32
        summary = zero.train(make_cfg(out / name, ZeroConfig, **GPT, stage=2, compile="blocks"))
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": _breaks(), "compile_s": summary["compile_s"]}


def _compile_sharded_root() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from manual_train.models import DataInfo, build_model

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = build_model("gpt", DataInfo("reverse", (16,), 32, predict=8))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.forward = torch.compile(model.forward, fullgraph=True)
        try:
            model(torch.randint(0, 32, (4, 16)))
        except torch._dynamo.exc.Unsupported as e:
            return {"error": str(e).splitlines()[0], "graphs": counters["stats"]["unique_graphs"]}
        return {"error": None, "graphs": counters["stats"]["unique_graphs"]}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_and_pipeline_compile_blocks_after_wrapping_and_train_as_eager(tmp_path, lone_process):
    """One 2-rank job (compiling dominates: see the module's docstring): graphs captured with no break, and 2 steps in
    64-true within 1e-9 of eager single.py; the sharded root compiled as one graph raises instead, no graph."""
    from jobs import run_job
    from manual_train.config import Config
    from manual_train.loops import single

    eager, _ = _train(single, Config, tmp_path, "eager", batch_size=32)
    results = run_job(_sharded_scenario, 2, tmp_path / "job", ["zero", "pipeline", "whole_sharded_root"],
                      ["manual_train.loops.zero", "manual_train.loops.pipeline", "manual_train.tokens"])
    for name in ("zero", "pipeline"):
        diff = max_param_diff(eager, load_model_state(tmp_path / "job" / name / "run"))
        print(f"{name} --compile blocks: {[r[name] for r in results]}; max diff from eager single.py {diff:.3g}")
        assert diff <= PARITY_TOL_64
        assert all(r[name]["graphs"] > 0 and r[name]["breaks"] == 0 for r in results), results
    print(f"the sharded root compiled whole: {results[0]['whole_sharded_root']}")
    assert all(r["whole_sharded_root"]["error"] and r["whole_sharded_root"]["graphs"] == 0 for r in results)


@pytest.mark.parametrize("config,argv,text", [
    ("data_parallel", dict(compile="model"), "DataParallel copies the module"),
    ("zero", dict(compile="model", impl="fairscale"), "fairscale's wrappers"),
    ("single", dict(compile="blocks", model="mlp"), "--model mlp has no repeated blocks to compile"),
    ("single", dict(compile="model", model="gpt", dataset="reverse", activation_checkpointing="full"),
     "with --activation-checkpointing is not built"),
])
def test_compile_is_refused_where_it_is_not_built(config, argv, text, tmp_path):
    from manual_train.config import Config
    from manual_train.data_parallel import DataParallelConfig
    from manual_train.zero import ZeroConfig

    with pytest.raises(UsageError, match=text):
        make_cfg(tmp_path, {"single": Config, "data_parallel": DataParallelConfig, "zero": ZeroConfig}[config], **argv)
