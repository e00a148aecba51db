"""A plan applied before FSDP2's fully_shard: real gloo processes on CPU, gradients
equal to the unsharded, unplanned model's."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import autosac
from autosac.models import build_model

CFG = dict(n_layer=2, dim=64, n_head=4, seq=64, vocab=128, batch=4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, plan_json, out_dir):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # as the parent: same CPU kernels, same reduction order
    try:
        torch.manual_seed(0)
        batch = CFG["batch"]
        model, idx = build_model("gpt2", device="cpu", batch=batch, **{k: v for k, v in CFG.items() if k != "batch"})
        autosac.apply(model, autosac.Plan.from_json(plan_json))
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        loss = model(idx).float().sum()
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"loss": loss.detach(), "grads": grads}, os.path.join(out_dir, "fsdp.pt"))
    finally:
        dist.destroy_process_group()


def test_plan_composes_with_fully_shard(tmp_path):
    torch.manual_seed(0)
    batch = CFG["batch"]
    model, idx = build_model("gpt2", device="cpu", batch=batch, **{k: v for k, v in CFG.items() if k != "batch"})
    stats = autosac.profile(model, idx, world_size=2)
    plan = autosac.solve(stats, "70%")
    assert plan.decisions
    loss = model(idx).float().sum()
    loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, plan.to_json(), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail("FSDP worker timed out")
        assert p.exitcode == 0
    got = torch.load(tmp_path / "fsdp.pt")
    assert torch.equal(got["loss"], loss.detach())
    for name, g in ref.items():
        # identical inputs on both ranks: the reduce-scatter mean of two equal
        # gradients is that gradient exactly
        assert torch.equal(got["grads"][name], g), name
