"""Downcast gathers under real FSDP2 (gloo processes on CPU): the step under
autocast is bitwise the same with and without the install, the all-gathers
move half the bytes of the downcast parameters, and the planner's per-rank
peak matches the measured one."""

from pathlib import Path

import pytest
import torch
from suite import A100_CPU_KERNELS, gloo_group, gpt, run_ranks
from torch import nn

import autosac
from autosac import zero3
from autosac.core.errors import PlanMismatchError
from autosac.models import build_model
from autosac.zero3.ops import GATHER

BF16 = torch.bfloat16
CFG = dict(n_layer=2, dim=64, n_head=4, seq=64, vocab=128)


def _stats(model, idx, **kw):
    return autosac.profile(model, idx, autocast=BF16, **kw)


def test_downcast_params_are_exactly_those_only_ever_cast():
    """Autocast runs linear layers in bf16, layer norms and embeddings in fp32:
    the blocks' Linear weights and biases are cast at every use; the tied
    embedding (a bf16 head and an fp32 lookup) and the norms are not."""
    model, idx = gpt(CFG, device="meta")
    expect = [f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.Linear) and m.startswith("blocks")
              for p in ("weight", "bias")]
    assert zero3.downcast_params(_stats(model, idx)) == expect
    assert zero3.downcast_params(autosac.profile(model, idx)) == []  # no autocast: nothing is cast


def test_installed_without_sharding_the_model_computes_the_same():
    model, idx = gpt(CFG)
    with torch.autocast("cpu", dtype=BF16):
        ref = model(idx)
    ref.float().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    chosen = zero3.install_downcast_gather(model, _stats(model, idx))
    assert all(isinstance(model.get_parameter(f), zero3.DowncastShard) for f in chosen)
    assert zero3.install_downcast_gather(model, _stats(model, idx)) == chosen  # again: no change
    with torch.autocast("cpu", dtype=BF16):
        out = model(idx)
    out.float().sum().backward()
    assert torch.equal(out, ref)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[n]), n


def _padded_numel(shape, world) -> int:
    rows = -(-shape[0] // world)
    return rows * (torch.Size(shape[1:]).numel() if len(shape) > 1 else 1)


def _step_worker(rank, world, port, installs, out_dir):
    """One rank: :func:`_install_and_step` for each of ``installs`` in turn, one process group for all."""
    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        for install in installs:
            _install_and_step(rank, world, install, out_dir)


def _install_and_step(rank, world, install, out_dir):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model, idx = gpt(CFG)
    stats = _stats(model, idx)
    chosen = zero3.install_downcast_gather(model, stats) if install == "before" else []
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if install == "after":
        chosen = zero3.install_downcast_gather(model, stats)
    # what each unit's all-gather must hand the collective: every parameter's
    # padded shard, in bf16 where downcast (computed here from shapes alone)
    expect = {}  # unit -> bytes: a block's parameters, or the root's (the rest)
    for name, p in gpt(CFG, device="meta")[0].named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ""
        expect[unit] = expect.get(unit, 0) + _padded_numel(p.shape, world) * (2 if name in chosen else 4)
    handed, real = [], getattr(dist, GATHER)

    def counting(output, input, *a, **k):
        handed.append(input.numel() * input.element_size())
        return real(output, input, *a, **k)

    setattr(dist, GATHER, counting)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        with torch.autocast("cpu", dtype=BF16):
            loss = model(idx).float().sum()
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    setattr(dist, GATHER, real)
    assert sorted(set(handed)) == sorted(set(expect.values())), (handed, expect)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"loss": losses, "grads": grads, "params": params, "handed": handed},
                   Path(out_dir) / f"install-{install}.pt")
    if install == "before":  # FSDP2's own mixed precision as well: refused before any gather
        model, idx = gpt(CFG)
        zero3.install_downcast_gather(model, _stats(model, idx))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
        with pytest.raises(ValueError, match="use one of them"):
            model(idx)
    if install == "after":  # refused on a model whose FSDP2 has gathered already, or with param_dtype
        model, idx = gpt(CFG)
        fully_shard(model)
        model(idx)
        with pytest.raises(ValueError, match="before its first step"):
            zero3.install_downcast_gather(model, stats)
        model, idx = gpt(CFG)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
        with pytest.raises(ValueError, match="shard without param_dtype"):
            zero3.install_downcast_gather(model, stats)


def test_fsdp2_step_is_bitwise_the_same_and_gathers_half_the_bytes(tmp_path):
    """Three ranks shard 64-row weights unevenly (FSDP2 pads): two AdamW steps
    under autocast with and without the install (before or after
    ``fully_shard``) give the same losses, gradients and updated parameters
    bit for bit.  The three runs share one spawn of the ranks."""
    from autosac.zero3 import native

    world = 3
    native.available()  # build once here, not in every rank
    run_ranks(_step_worker, world, [None, "before", "after"], str(tmp_path))
    base = torch.load(tmp_path / "install-None.pt")
    model, idx = gpt(CFG, device="meta")
    chosen = zero3.downcast_params(_stats(model, idx))
    per_step = sum(_padded_numel(model.get_parameter(f).shape, world) * 2 for f in chosen)
    for when in ("before", "after"):
        got = torch.load(tmp_path / f"install-{when}.pt")
        assert all(torch.equal(a, b) for a, b in zip(base["loss"], got["loss"])), when
        for name in base["grads"]:
            assert torch.equal(base["grads"][name], got["grads"][name]), (when, name)
            assert torch.equal(base["params"][name], got["params"][name]), (when, name)
        saved = sum(base["handed"]) - sum(got["handed"])
        assert saved == 2 * 2 * per_step, when  # each block gathered in forward and backward, two steps


# small: bfloat16 matmuls on a CPU without bf16 instructions run ~40x slower than float32
MEM_CFG = dict(n_layer=4, dim=128, n_head=4, seq=128, vocab=2048, dropout=0.0)


def _peak_worker(rank, world, port, plan_json, out_dir):
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    with gloo_group(rank, world, port):
        torch.manual_seed(0)
        model, idx = build_model("gpt2", device="cpu", batch=4, **MEM_CFG)
        plan = autosac.Plan.from_json(plan_json)
        if plan.decisions:
            autosac.apply(model, plan)
        zero3.install_downcast_gather(model, plan)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        peak = autosac.measure(model, idx, optimizer="adamw", steps=0, autocast=BF16).peak_bytes
        (Path(out_dir) / f"rank{rank}").write_text(str(peak))


def test_the_planner_counts_downcast_gathers_as_fsdp2_holds_them(tmp_path):
    """Per-rank peak on 2 gloo ranks with the install, against the prediction
    of stats made with with_downcast_gather: without a plan and with one."""
    model, idx = build_model("gpt2", device="meta", batch=4, **MEM_CFG)
    stats = autosac.profile(model, idx, optimizer="adamw", target=A100_CPU_KERNELS, world_size=2, autocast=BF16)
    downcast = zero3.with_downcast_gather(stats)
    assert not stats.gathered_dtypes and len(downcast.gathered_dtypes) == 8 * 4
    everything = autosac.solve(downcast, "100%")  # nothing to checkpoint: the step as it is
    planned = autosac.solve(downcast, "75%")
    assert not everything.decisions and planned.decisions and planned.gathered_dtypes == downcast.gathered_dtypes
    assert everything.predicted_peak_bytes < autosac.solve(stats, "100%").predicted_peak_bytes
    for plan in (everything, planned):
        run_ranks(_peak_worker, 2, plan.to_json(), str(tmp_path))
        measured = max(int((tmp_path / f"rank{r}").read_text()) for r in range(2))
        assert abs(plan.predicted_peak_bytes - measured) <= 0.05 * measured, (plan.predicted_peak_bytes, measured)


def test_bad_input_is_one_clear_error_and_changes_nothing():
    model, idx = gpt(CFG)
    stats = _stats(model, idx)
    before = dict(model.named_parameters())

    def unchanged():
        return all(p is before[n] for n, p in model.named_parameters())

    with pytest.raises(ValueError, match="bfloat16 or torch.float16"):
        zero3.install_downcast_gather(model, stats, torch.float32)
    with pytest.raises(ValueError, match="traced without autocast"):
        zero3.install_downcast_gather(model, autosac.profile(model, idx))
    with pytest.raises(ValueError, match="under autocast bfloat16"):
        zero3.install_downcast_gather(model, stats, torch.float16)
    with pytest.raises(ValueError, match="solved without a downcast gather"):
        # 'least': on the default h100 target cuBLAS's 64 MiB workspace leaves this tiny model no 80 %
        zero3.install_downcast_gather(model, autosac.solve(stats, "least"))
    with pytest.raises(PlanMismatchError, match="profile this model"):
        zero3.install_downcast_gather(gpt(CFG, n_layer=3)[0], stats)
    with pytest.raises(TypeError, match="ModelStats or autosac.Plan"):
        zero3.install_downcast_gather(model, "plan.json")
    with pytest.raises(TypeError, match="nn.Module"):
        zero3.install_downcast_gather(stats, stats)
    assert unchanged()
    mixed = autosac.profile(*gpt(CFG, device="meta"), world_size=2, param_dtype=BF16)
    with pytest.raises(ValueError, match="profile without param_dtype"):
        zero3.with_downcast_gather(mixed)


def test_a_use_the_trace_did_not_see_raises_instead_of_computing_with_rounded_values():
    gathered = zero3.DowncastGathered(torch.ones(4, dtype=BF16), torch.float32, "blocks.0.mlp.fc.weight")
    assert gathered.dtype == torch.float32
    cast = gathered.to(BF16)
    assert cast.dtype == BF16 and cast.untyped_storage().data_ptr() == gathered._data.untyped_storage().data_ptr()
    assert isinstance(gathered.view(2, 2), zero3.DowncastGathered)
    with pytest.raises(RuntimeError, match="blocks.0.mlp.fc.weight is gathered in torch.bfloat16"):
        gathered * 2
    cast.mul_(3)  # a write through the cast writes the gathered parameter: refused at its next use
    with pytest.raises(RuntimeError, match="cast of blocks.0.mlp.fc.weight was written in place"):
        gathered.to(BF16)


def _meta_worker(rank, world, port, when):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, world, port):
        model, idx = gpt(CFG, device="meta")
        stats = _stats(model, idx)
        if when == "before":
            zero3.install_downcast_gather(model, stats)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if when == "after":
            zero3.install_downcast_gather(model, stats)
        model.to_empty(device="cpu")  # plain tensors replace the marked shards
        with torch.no_grad():
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
        handed, real = [], getattr(dist, GATHER)

        def counting(output, input, *a, **k):
            handed.append(input.dtype)
            return real(output, input, *a, **k)

        setattr(dist, GATHER, counting)
        with torch.autocast("cpu", dtype=BF16):
            model(torch.randint(0, CFG["vocab"], (4, CFG["seq"]))).float().sum().backward()
        setattr(dist, GATHER, real)
        # the root's fp32 parameters, then each block in forward and backward: bf16 and fp32 as bytes
        assert handed == [torch.float32] + [torch.uint8] * 4, handed
        # the state dict holds plain local shards (what checkpointers load), and loads back in place
        state = model.state_dict()
        assert not any(isinstance(v._local_tensor, zero3.DowncastShard) for v in state.values())
        saved = {k: v._local_tensor.clone() for k, v in state.items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        for k, v in model.state_dict().items():
            v._local_tensor.copy_(saved[k])  # as a checkpoint loader writes into the state dict
        for k, v in model.state_dict().items():
            assert torch.equal(v._local_tensor, saved[k]), k
        assert isinstance(model.blocks[0].mlp.fc.weight._local_tensor, zero3.DowncastShard)
        assert torch.equal(model.blocks[0].mlp.fc.weight._local_tensor._data, saved["blocks.0.mlp.fc.weight"])
        dist.barrier()


@pytest.mark.parametrize("when", ["before", "after"])
def test_building_on_meta_then_to_empty_keeps_the_downcast_gather(when):
    """The usual FSDP2 start (build on meta, shard, to_empty) gathers as
    planned, and the state dict holds plain shards that load back in place."""
    run_ranks(_meta_worker, 2, when)


def test_the_installed_model_keeps_its_parameter_objects_and_plain_checkpoints():
    import copy
    import io

    model, idx = gpt(CFG)
    weight = model.blocks[0].mlp.fc.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before the install
    zero3.install_downcast_gather(model, _stats(model, idx))
    assert model.blocks[0].mlp.fc.weight is weight and isinstance(weight, zero3.DowncastShard)
    with torch.autocast("cpu", dtype=BF16):
        model(idx).float().sum().backward()
    old = weight._data.clone()
    opt.step()
    assert not torch.equal(weight._data, old)  # the optimizer steps the marked parameter
    state = model.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    twin = copy.deepcopy(model)
    assert isinstance(twin.blocks[0].mlp.fc.weight, zero3.DowncastShard)
    assert torch.equal(twin.blocks[0].mlp.fc.weight._data, weight._data)
    with torch.no_grad():
        weight.zero_()
    model.load_state_dict(loaded)
    assert torch.equal(weight._data, loaded["blocks.0.mlp.fc.weight"]) and weight._data.abs().sum() > 0


def _changed_worker(rank, world, port, change):
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, world, port):
        model, idx = gpt(CFG)
        zero3.install_downcast_gather(model, _stats(model, idx))
        if change == "data":
            model.blocks[0].mlp.fc.weight.data = torch.zeros(256, 64)
        else:
            model.double()
        with pytest.raises(RuntimeError, match="was changed after install_downcast_gather"):
            for block in model.blocks:
                fully_shard(block)


@pytest.mark.parametrize("change", ["data", "dtype"])
def test_a_parameter_changed_after_the_install_is_refused_not_gathered_stale(change):
    run_ranks(_changed_worker, 1, change)


def test_the_cli_plans_with_downcast_gathers(tmp_path, capsys):
    from autosac.cli import main

    common = ["plan", "--model", "gpt2", "--model-arg", "n_layer=2", "--model-arg", "dim=64", "--model-arg",
              "n_head=4", "--model-arg", "vocab=128", "--seq", "64", "--batch", "4", "--world-size", "2",
              "--budget", "least"]  # on the default h100 cuBLAS's 64 MiB workspace leaves this model no 80 %
    assert main([*common, "--autocast", "bf16", "--downcast-gather", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "downcast gather  16 parameters gathered in bfloat16" in out
    plan = autosac.Plan.load(tmp_path / "p.json")
    assert len(plan.gathered_dtypes) == 16
    model, _ = gpt(CFG)
    assert len(zero3.install_downcast_gather(model, plan)) == 16
    assert main([*common, "--downcast-gather"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "autosac: ValueError: --downcast-gather needs --world-size > 1 and --autocast (bf16 or fp16)"
