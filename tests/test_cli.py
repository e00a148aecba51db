"""The ``autosac`` command (through its real entry point where it matters):
plan and verify output, user mistakes as one line, the console entry point,
model arguments and factories, hf: models built on meta, llama-7b on meta,
the MoE routing flags, and a plan made for compile verified compiled."""

import re
import subprocess
import sys

import pytest
from suite import HF_SMALL

import autosac
from autosac.cli import main
from autosac.core.plan import Plan
from autosac.models import build_model


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


@pytest.mark.parametrize(
    "argv,match",
    [
        (["plan", "--budget", "abc"], "cannot parse budget 'abc'"),
        # what a command line can say: no "float of GiB" (a new user's 1e8 was offered one)
        (["plan", "--budget", "1e8"], r"cannot parse budget '1e8': use \"8GiB\", .* or whole bytes such as "
                                      r"\"100000000\"$"),
        (["plan", "--budget", "1KiB", "--model", "gpt-tiny"], "InfeasibleBudgetError: budget 1.00 KiB"),
        (["plan", "--budget", "50%", "--model", "nope"], "unknown built-in model 'nope'"),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--model-arg", "layers=2"], "unknown GPTConfig field"),
        (["plan", "--budget", "50%", "--model", "no.such.module:f"], "cannot import .no.such.module."),
        (["plan", "--budget", "50%", "--model", "gpt-tiny", "--target", "tpu"], r"--target: invalid choice: 'tpu' \(choose from 'h100'"),
        (["verify", "/no/such/plan.json"], "No such file"),
        (["plan", "--budget", "50%", "--batch", "-3"], "is not positive"),
        (["plan", "--budget", "90%", "--model", "gpt-tiny", "--target", "cpu", "--json", "/"],
         "IsADirectoryError|Errno"),
        (["plan", "--budget", "90%", "--model", "gpt-tiny", "--param-dtype", "bf16"], "needs world_size > 1"),
        (["plan", "--budget", "90%", "--model", "gpt-tiny", "--autocast", "fp32"], "invalid choice: 'fp32'"),
        (["plan", "--budget", "90%", "--seq", "-1"], r"--seq: -1 is not positive \(autosac plan --help"),
        (["verify", "p.json", "--steps", "0"], "--steps: 0 is not positive"),
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
    assert len(lines) == 1, lines  # argparse's own mistakes too: no usage block before the line
    assert __import__("re").search(match, lines[-1]), lines[-1]


@pytest.mark.parametrize("module", ["autosac.cli", "autosac"])  # a new user tried python -m autosac
def test_the_console_entry_point_reports_a_mistake_in_one_line(module):
    proc = subprocess.run([sys.executable, "-m", module, "plan", "--budget", "50%", "--model",
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


def test_verify_runs_the_plan_and_refuses_other_shapes(tmp_path, capsys):
    path = str(tmp_path / "p.json")
    common = ["--model", "gpt-tiny", "--batch", "2", "--seq", "64", "--target", "cpu"]
    assert main(["plan", *common, "--budget", "85%", "--json", path]) == 0
    capsys.readouterr()
    assert main(["verify", path, *common, "--steps", "1", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "peak, with the plan" in out and "kept" in out
    # the models without and with the plan take turns (a new user's single runs read +22 % and +53 %)
    found = re.search(r"measured overhead ([-+][0-9.]+)% \(predicted [-+][0-9.]+%\): the median over 3 interleaved "
                      r"rounds, ([-+][0-9.]+)% to ([-+][0-9.]+)%", out)
    assert found and float(found[2]) <= float(found[1]) <= float(found[3]), out
    err = _cli_error(capsys, "verify", path, "--model", "gpt-tiny", "--batch", "4", "--seq", "64")
    assert "made for inputs args[0] (2, 64) int64, not args[0] (4, 64) int64" in err


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
