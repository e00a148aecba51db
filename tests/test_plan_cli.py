"""Plan JSON, its errors, and the command line (through its real entry point)."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

import autosac
from autosac.cli import main
from autosac.core.host import HostCosts
from autosac.core.plan import Plan
from autosac.models import build_model


@pytest.fixture(scope="module")
def plan():
    model, idx = build_model("seed-transformer", n_layer=2, seq=256)
    return autosac.solve(model, "78%", example_inputs=idx)


def test_plan_json_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again == plan
    assert again.decisions and all(0 < r <= 1 for r in again.decisions.values())
    assert again.predicted_peak_bytes <= again.budget_bytes < again.baseline_peak_bytes
    ops = [o for d in again.details.values() for o in d.ops]
    assert ops and all(o.occurrence >= 0 and o.bytes > 0 for o in ops)
    # the table names every decision
    text = str(again)
    for fqn in again.decisions:
        assert fqn in text
    assert "planned peak" in text and "budget" in text


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d.update(format=7), "plan format 7"),
        (lambda d: d.pop("decisions"), "malformed plan"),
        (lambda d: d["decisions"].update({k: 1.5 for k in d["decisions"]}), r"not in \(0, 1\]"),
        (lambda d: d["decisions"].update({"extra": 0.5}), "different modules"),
    ],
)
def test_corrupted_or_edited_plan_is_refused(plan, tmp_path, edit, match):
    data = json.loads(plan.to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(autosac.StatsFormatError, match=match):
        Plan.load(path)
    path.write_text(plan.to_json()[:100])
    with pytest.raises(autosac.StatsFormatError, match="not a plan JSON"):
        Plan.load(path)


def test_nesting_is_checked_for_every_prefix(plan):
    data = json.loads(plan.to_json())
    fqn, detail = next(iter(data["details"].items()))
    for name in ("blocks.0", "blocks.0-x", "blocks.0.attn"):
        data["decisions"][name] = 0.5
        data["details"][name] = {**detail, "fqn": name}
    for name in list(data["decisions"]):
        if name not in ("blocks.0", "blocks.0-x", "blocks.0.attn"):
            data["decisions"].pop(name)
            data["details"].pop(name)
    with pytest.raises(autosac.StatsFormatError, match="'blocks.0.attn' is nested inside checkpointed 'blocks.0'"):
        Plan.from_json(json.dumps(data))


def test_plan_from_given_decisions_renders_and_round_trips(plan):
    from autosac.solver import plan_from_decisions

    model, idx = build_model("seed-transformer", n_layer=2, seq=256)
    stats = autosac.profile(model, idx)
    given = plan_from_decisions(stats, {"blocks.0": 1.0, "blocks.1.attn": 0.5})
    assert given.decisions["blocks.0"] == 1.0 and given.decisions["blocks.1.attn"] >= 0.5
    assert "given" in str(given)
    assert Plan.from_json(given.to_json()) == given
    with pytest.raises(ValueError, match="nested inside"):
        plan_from_decisions(stats, {"blocks.0": 1.0, "blocks.0.attn": 1.0})


def test_cli_plan_prints_decisions_and_writes_json(tmp_path, capsys):
    out_path = tmp_path / "p.json"
    code = main(["plan", "--model", "seed-transformer", "--model-arg", "n_layer=2", "--seq", "256",
                 "--budget", "78%", "--json", str(out_path)])
    out = capsys.readouterr().out
    assert code == 0
    plan = Plan.load(out_path)
    for fqn in plan.decisions:
        assert fqn in out
    for label in ("baseline peak", "planned peak", "budget", "recompute", "discard"):
        assert label in out


def test_cli_plan_under_autocast_says_so_in_the_plan(tmp_path, capsys):
    path = tmp_path / "p.json"
    # budget 'least': on the default h100 target cuBLAS's 64 MiB workspace leaves this tiny model no 80 %
    common = ["--model", "llama-tiny", "--batch", "8", "--seq", "64", "--optimizer", "none", "--budget", "least"]
    assert main(["plan", *common, "--json", str(path)]) == 0
    fp32 = Plan.load(path)
    assert main(["plan", *common, "--autocast", "bf16", "--json", str(path)]) == 0
    bf16 = Plan.load(path)
    assert (fp32.autocast, bf16.autocast) == ("", "bfloat16")
    assert bf16.baseline_peak_bytes != fp32.baseline_peak_bytes  # traced in other dtypes


def test_cli_plan_and_verify_with_gradient_accumulation(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    common = ["--model", "llama-tiny", "--batch", "2", "--seq", "32", "--optimizer", "sgd", "--target", "cpu"]
    assert main(["plan", *common, "--grad-accumulation", "4", "--budget", "90%", "--json", path]) == 0
    assert "accumulation     4 micro-batches per optimizer step" in capsys.readouterr().out
    plan = Plan.load(path)
    assert plan.grad_accumulation == 4
    assert main(["verify", path, *common, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "kept" in out and "EXCEEDED" not in out


def test_cli_sweep_reuses_one_profile(capsys):
    code = main(["sweep", "--model", "seed-transformer", "--model-arg", "n_layer=2", "--seq", "256",
                 "--budgets", "95%,85%,1KiB,least"])
    out = capsys.readouterr().out
    assert code == 0
    rows = out.strip().splitlines()
    plans = [r for r in rows if r.endswith("optimal")]
    assert len(plans) == 3  # "least" plans at the least feasible budget
    overheads = [float(r.split()[6].rstrip("%")) for r in plans]
    assert overheads == sorted(overheads)  # less memory, more recompute
    assert any("infeasible (least peak" in r for r in rows)
    assert any(r.strip().startswith("every block") for r in rows) and any(r.strip().startswith("none") for r in rows)


def test_sweep_measured_keeps_each_budget_and_plots(tmp_path):
    """Each point's plan, run for real, keeps its budget and peaks where it
    was predicted; checkpointing every block is the repeated layers; the plot
    is written."""
    pytest.importorskip("matplotlib")
    from autosac.tools.plot import pareto_plot
    from autosac.tools.report import sweep_table
    from autosac.tools.sweep import measure_sweep, repeated_blocks, sweep

    model, idx = build_model("seed-transformer", n_layer=3, dim=384, n_head=6, seq=96, device="cpu")
    stats = autosac.profile(model, idx, target="cpu", optimizer="sgd")
    assert repeated_blocks(stats) == ["blocks.0", "blocks.1", "blocks.2"]
    result = sweep(stats, ["95%", "90%", "1KiB"])
    assert [p.plan is not None for p in result.points] == [True, True, False]
    assert result.least_peak_bytes is not None and result.least_peak_bytes > 1024
    measure_sweep(result, model, idx, steps=1, rounds=2)
    for p in [*result.points[:2], result.full_ac]:
        assert p.measured_peak_bytes <= p.budget_bytes or p is result.full_ac, (p.measured_peak_bytes, p.budget_bytes)
        assert abs(p.measured_peak_bytes - p.peak_bytes) <= 0.01 * p.measured_peak_bytes
    assert abs(result.measured_baseline_peak_bytes - result.baseline_peak_bytes) <= 0.01 * result.baseline_peak_bytes
    # torch.utils.checkpoint itself around every block, measured in the same run: the peak the
    # prediction of checkpointing every block names
    ckpt = result.torch_checkpoint
    assert ckpt.modules == 3 and ckpt.measured_overhead is not None
    assert abs(ckpt.measured_peak_bytes - result.full_ac.peak_bytes) <= 0.01 * ckpt.measured_peak_bytes
    assert "torch.utils.checkpoint of every block, measured" in sweep_table(result)
    pareto_plot(result, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pareto_plot(result, tmp_path / "pareto.svg")
    assert b"<svg" in (tmp_path / "pareto.svg").read_bytes()[:400]


def test_plot_without_matplotlib_is_one_line_naming_the_extra(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from autosac.cli import main; "
            f"sys.exit(main(['sweep', '--model', 'gpt-tiny', '--plot', {str(tmp_path / 'p.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "autosac: error: --plot needs matplotlib: pip install 'autosac[plot]'"
    assert not (tmp_path / "p.png").exists()


def test_progress_shows_on_a_terminal_only_and_never_with_quiet():
    import os
    import pty

    # --target cpu: on a CUDA target cuBLAS's 64 MiB workspace leaves gpt-tiny no 90 %
    argv = [sys.executable, "-m", "autosac.cli", "plan", "--model", "gpt-tiny", "--budget", "90%", "--target", "cpu"]
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr.strip() == ""
    for quiet in (False, True):
        leader, follower = pty.openpty()
        proc = subprocess.run(argv + (["--quiet"] if quiet else []), stdout=subprocess.PIPE, stderr=follower,
                              timeout=120)
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
        os.close(leader)
        assert proc.returncode == 0
        text = shown.decode()
        if quiet:
            assert "profiling" not in text
        else:
            assert "autosac: profiling GPT (one training step in fake mode):" in text and "solving for 90%" in text


@pytest.mark.parametrize(
    "argv,match",
    [
        (["plan", "--budget", "abc"], "cannot parse budget 'abc'"),
        (["plan", "--budget", "1KiB", "--model", "gpt-tiny"], "InfeasibleBudgetError: budget 1.00 KiB"),
        (["plan", "--budget", "50%", "--model", "nope"], "unknown built-in model 'nope'"),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--model-arg", "layers=2"], "unknown GPTConfig field"),
        (["plan", "--budget", "50%", "--model", "no.such.module:f"], "cannot import .no.such.module."),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--target", "tpu"], "unknown target 'tpu'"),
        (["verify", "/no/such/plan.json"], "No such file"),
        (["plan", "--budget", "50%", "--batch", "-3"], "is not positive"),
        (["plan", "--budget", "90%", "--model", "gpt-tiny", "--target", "cpu", "--json", "/"],
         "IsADirectoryError|Errno"),
        (["plan", "--budget", "90%", "--model", "gpt-tiny", "--param-dtype", "bf16"], "needs world_size > 1"),
        (["plan", "--budget", "90%", "--model", "gpt-tiny", "--autocast", "fp32"], "invalid choice: 'fp32'"),
    ],
)
def test_cli_user_mistakes_are_one_line(argv, match, capsys):
    """In process (a subprocess each took 4 s of imports); the entry point
    itself is run as a process below."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    # one line -- after argparse's usage text, for mistakes argparse itself catches
    assert len(lines) == 1 or lines[0].startswith("usage:")
    assert __import__("re").search(match, lines[-1]), lines[-1]


def test_the_console_entry_point_reports_a_mistake_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "autosac.cli", "plan", "--budget", "50%", "--model",
                           "no.such.module:f"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot import 'no.such.module'" in proc.stderr or "cannot import" in proc.stderr


@pytest.mark.parametrize(
    "argv,match",
    [
        (["plan", "--budget", "50%", "--model", "hf:t5"], "unknown hf: model 't5': use one of hf:llama"),
        (["plan", "--budget", "50%", "--model", "hf:llama", "--model-arg", "hidden_sise=64"],
         "LlamaConfig has no hidden_sise"),
        (["plan", "--budget", "50%", "--model", "hf:gpt2", "--model-arg", "n_layer=1", "--seq", "4096"],
         "longer than hf:gpt2's 1024 positions: raise --model-arg n_positions=4096"),
        (["plan", "--budget", "50%", "--model", "hf:gpt2", "--model-arg", "n_layer=1", "--model-arg", "vocab_size=0"],
         "needs a positive vocab_size"),
        (["sweep", "--model", "gpt-tiny", "--plot", "/tmp/pareto"], "name a file ending in .png, .svg or .pdf"),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--world-size", "2", "--compile", "aot_eager"],
         r"one process \(world_size=1\)"),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--world-size", "2", "--compile", "inductor",
          "--target", "cpu"], r"one process \(world_size=1\)"),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--compile", "tensorrt", "--target", "cpu"],
         "compile= must be one of 'inductor', 'aot_eager'"),
        (["plan", "--budget", "least", "--model", "gpt-tiny", "--compile", "aot_eager", "--target", "cpu"],
         "under torch.compile give the budget as a size or a percentage"),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--compile", "aot_eager", "--target", "cpu",
          "--grad-accumulation", "2"], "traced for the default loop: leave grad_accumulation at 1"),
    ],
)
def test_cli_mistakes_found_before_any_work_are_one_line(argv, match, capsys):
    """In process (quicker than a subprocess each); the same one-line contract."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert __import__("re").search(match, err), err


def test_llama_7b_planned_on_meta_in_ci():
    model, idx = build_model("llama-7b")
    assert all(p.is_meta for p in model.parameters())
    stats = autosac.profile(model, idx, target="h100", world_size=8)
    plan = autosac.solve(stats, "40GiB")
    assert plan.predicted_peak_bytes <= 40 * 2**30
    assert plan.solver["status"] == "optimal"
    assert any(f.startswith("layers.") for f in plan.decisions)


def test_binary_plan_file_is_one_clear_error(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(autosac.StatsFormatError, match="not UTF-8 text"):
        Plan.load(path)


def _cli_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


def test_model_arguments_are_checked_by_name(capsys):
    common = ["plan", "--budget", "60%", "--model", "gpt-tiny"]
    assert "GPTConfig.n_layer must be a whole number, got 'abc'" in _cli_error(capsys, *common, "--model-arg", "n_layer=abc")
    assert "GPTConfig.n_layer must be positive, got 0" in _cli_error(capsys, *common, "--model-arg", "n_layer=0")
    with pytest.raises(SystemExit):
        main([*common, "--time-limit", "-1"])
    assert "is not positive" in capsys.readouterr().err


def test_model_module_that_does_not_import_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_model.py").write_text("def build(:\n    pass\n")
    (tmp_path / "plain_model.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    err = _cli_error(capsys, "plan", "--budget", "60%", "--model", "broken_model:build")
    assert "cannot import 'broken_model'" in err and "SyntaxError" in err and "line 1" in err
    err = _cli_error(capsys, "plan", "--budget", "60%", "--model", "plain_model:build", "--batch", "2", "--seq", "4")
    assert "without a vocabulary size" in err and "return (model, example_inputs)" in err


def test_reserve_errors_name_the_reserve():
    model, idx = build_model("gpt-tiny", device="cpu", batch=2)
    stats = autosac.profile(model, idx)
    with pytest.raises(ValueError, match="cannot parse reserve 'lots'"):
        autosac.solve(stats, "90%", reserve="lots")
    with pytest.raises(ValueError, match="time_limit_s must be a positive number"):
        autosac.solve(stats, "90%", time_limit_s=-1)


def test_infeasible_message_tells_sizes_that_round_alike_apart():
    from autosac.solver import least_peak
    from autosac.solver.problem import build_problem

    model, idx = build_model("gpt-tiny", device="cpu", batch=2)
    stats = autosac.profile(model, idx)
    least, _ = least_peak(build_problem(stats))
    with pytest.raises(autosac.InfeasibleBudgetError, match=r"bytes\) is below the least reachable peak .* bytes\)"):
        autosac.solve(stats, least - 1)


def test_unapply_of_something_else_is_a_type_error():
    with pytest.raises(TypeError, match="unapply needs an nn.Module, got str"):
        autosac.unapply("x")


def test_inputs_that_do_not_fit_raise_one_clear_error_without_log_noise(capfd):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(autosac.TraceError, match="check that example_inputs fit"):
        autosac.profile(model, torch.randn(4, 5))
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "fake_tensor" not in err


def test_verify_runs_the_plan_and_refuses_other_shapes(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    common = ["--model", "gpt-tiny", "--batch", "2", "--seq", "64", "--target", "cpu"]
    assert main(["plan", *common, "--budget", "85%", "--json", path]) == 0
    capsys.readouterr()
    assert main(["verify", path, *common, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "peak, with the plan" in out and "kept" in out
    err = _cli_error(capsys, "verify", path, "--model", "gpt-tiny", "--batch", "4", "--seq", "64")
    assert "made for inputs args[0] (2, 64) int64, not args[0] (4, 64) int64" in err


HF_SMALL = {
    "llama": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=172", "num_attention_heads=4",
              "num_key_value_heads=2", "vocab_size=256"],
    "mistral": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=172", "num_attention_heads=4",
                "num_key_value_heads=2", "vocab_size=256"],
    "qwen2": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=172", "num_attention_heads=4",
              "num_key_value_heads=2", "vocab_size=256"],
    "gpt2": ["n_layer=2", "n_embd=64", "n_head=4", "vocab_size=256"],
    "bert": ["num_hidden_layers=2", "hidden_size=64", "intermediate_size=256", "num_attention_heads=4",
             "vocab_size=256"],
}


MIXTRAL_SMALL = ["vocab_size=256", "hidden_size=64", "intermediate_size=128", "num_hidden_layers=2",
                 "num_attention_heads=4", "num_key_value_heads=2", "num_local_experts=4"]


def test_an_moe_plan_states_its_routing_and_verify_reports_the_routing_measured(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = str(tmp_path / "p.json")
    common = ["--model", "hf:mixtral", *[x for a in MIXTRAL_SMALL for x in ("--model-arg", a)], "--batch", "2",
              "--seq", "64", "--target", "cpu", "--drop-output", "--optimizer", "sgd"]
    assert main(["plan", *common, "--routing", "1.5", "--budget", "least", "--json", path]) == 0
    out = capsys.readouterr().out
    assert "MoE routing      capacity factor 1.5, assumed at 2 routing decisions (2 of 4 experts per token, " \
           "128 tokens)" in out
    assert main(["verify", path, *common, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "budget" in out and "kept" in out
    found = re.search(r"MoE routing: planned for capacity factor 1.5, .*; measured: the busiest expert got "
                      r"([0-9.]+)x its balanced share \(capacity factor \1\) over 2 routing decisions", out)
    assert found and 1.0 <= float(found.group(1)) <= 2.0, out


def test_a_malformed_routing_is_one_line_before_any_work(capsys):
    err = _cli_error(capsys, "plan", "--model", "gpt-tiny", "--budget", "80%", "--routing", "even")
    assert "routing must be 'balanced', 'worst' or a capacity factor >= 1" in err


@pytest.mark.parametrize("name", sorted(HF_SMALL))
def test_hf_models_are_built_from_their_config_on_meta_and_planned(name, capsys):
    """hf:NAME builds the transformers class from its config (no download) on
    meta, with token ids from the config's vocabulary; the plan names its layers."""
    pytest.importorskip("transformers")
    from autosac.models.spec import build_from_spec

    args = HF_SMALL[name]
    model, ids = build_from_spec(f"hf:{name}", args, batch=2, seq=128)
    assert model.training and all(p.is_meta for p in model.parameters())
    assert type(model).__module__.startswith("transformers.")
    assert ids.shape == (2, 128) and ids.device.type == "meta" and model.config.vocab_size == 256
    assert model.config.num_hidden_layers == 2
    if name not in ("llama", "bert"):  # one decoder and one encoder through the whole command
        return
    # --target cpu: on a CUDA target cuBLAS's 64 MiB workspace leaves these tiny models no 85 %
    code = main(["plan", "--model", f"hf:{name}", *[x for a in args for x in ("--model-arg", a)],
                 "--batch", "2", "--seq", "128", "--budget", "85%", "--optimizer", "sgd", "--target", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"model            {type(model).__name__}" in out


def test_the_plan_table_lists_modules_in_model_order_and_names_where_ops_ran():
    model, idx = build_model("gpt2", device="meta", batch=8, n_layer=12, dim=128, n_head=4, seq=256, vocab=512)
    # kernels alone (no host costs, which this machine's calibration sets): the same plan in every run
    h100 = dataclasses.replace(autosac.DEVICES["h100"], host=HostCosts())
    plan = autosac.solve(model, "50%", idx, target=h100)
    rows = [line.split()[0] for line in str(plan).splitlines()[1:] if line.startswith("blocks.")]
    assert len(rows) >= 11 and rows.index("blocks.2") < rows.index("blocks.10")
    assert rows == sorted(rows, key=lambda f: int(f.split(".")[1]))
    assert list(plan.decisions) == list(plan.details) == rows
    labels = [o.label for d in plan.details.values() for o in d.ops]
    assert "mlp.fc:addmm" in labels and "ln_1:layer_norm" in labels  # the submodule, and aten's name without native_
    assert Plan.from_json(plan.to_json()).details == plan.details  # the order survives JSON


def test_sweep_budgets_mean_what_solve_budgets_mean_sharded_and_with_a_reserve():
    from autosac.tools.sweep import sweep

    model, idx = build_model("gpt2", device="meta", batch=8, n_layer=4, dim=128, n_head=4, seq=256, vocab=512)
    stats = autosac.profile(model, idx, world_size=4)
    # 70 %, not 60 %: the h100 peak counts cuBLAS's 64 MiB workspace, which no plan lowers
    result = sweep(stats, ["80%", "70%"], reserve="1MiB")
    for text, point in zip(["80%", "70%"], result.points):
        plan = autosac.solve(stats, text, reserve="1MiB")
        assert point.budget_bytes == plan.budget_bytes
        assert point.plan is not None and point.plan.decisions == plan.decisions
    assert result.baseline_peak_bytes == plan.baseline_peak_bytes != stats.peak_bytes


def test_hf_config_dtype_is_the_weights_dtype():
    pytest.importorskip("transformers")
    from autosac.models.spec import build_from_spec

    args = HF_SMALL["llama"]
    model, _ = build_from_spec("hf:llama", [*args, "dtype=bfloat16"], batch=2, seq=64)
    assert {p.dtype for p in model.parameters()} == {__import__("torch").bfloat16}
    plain, _ = build_from_spec("hf:llama", args, batch=2, seq=64)
    assert {p.dtype for p in plain.parameters()} == {__import__("torch").float32}


def test_the_blocks_of_a_mixture_of_experts_are_its_layers_not_one_layers_experts():
    import torch
    from torch import nn

    from autosac.tools.sweep import repeated_blocks

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(4))

        def forward(self, x):
            return x + sum(e(x) for e in self.experts)

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    stats = autosac.profile(MoE(), torch.randn(64, 32), target="cpu")
    assert repeated_blocks(stats) == ["layers.0", "layers.1"]


def test_a_plan_made_for_compile_is_verified_compiled(tmp_path, capsys):
    small = ["--model", "gpt2", "--model-arg", "n_layer=2", "--model-arg", "dim=64", "--model-arg", "n_head=4",
             "--model-arg", "vocab=128", "--model-arg", "dropout=0.0", "--batch", "2", "--seq", "128",
             "--target", "cpu", "--optimizer", "sgd"]
    path = str(tmp_path / "p.json")
    assert main(["plan", *small, "--budget", "90%", "--compile", "aot_eager", "--json", path]) == 0
    plan = Plan.load(path)
    assert plan.compiled["backend"] == "aot_eager"
    capsys.readouterr()
    assert main(["verify", path, *small, "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "measured compiled" in out and "kept" in out


def test_hf_without_transformers_is_one_line_naming_the_extra():
    code = ("import sys; sys.modules['transformers'] = None; from autosac.cli import main; "
            "sys.exit(main(['plan', '--model', 'hf:llama', '--budget', '50%']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "autosac: error: hf: models need transformers: pip install 'autosac[hf]'"


def test_a_factory_next_to_where_the_command_runs_is_found(tmp_path):
    """The console script does not put the current directory on sys.path; a
    package.module:factory spec is looked up there too, as `python -m` would."""
    import shutil

    (tmp_path / "here_model.py").write_text(
        "from autosac.models import build_model\n\n"
        "def build():\n    return build_model('gpt-tiny')\n"
    )
    script = shutil.which("autosac")
    assert script is not None
    proc = subprocess.run([script, "plan", "--model", "here_model:build", "--budget", "90%", "--target", "cpu",
                           "--quiet"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "planned peak" in proc.stdout
