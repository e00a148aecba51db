"""Sweeps: one profile for many budgets (budgets meaning what solve's mean),
measured sweeps and their plots, and the progress display."""

import subprocess
import sys

import pytest

import autosac
from autosac.cli import main
from autosac.models import build_model


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

    model, idx = build_model("seed-transformer", n_layer=3, dim=192, n_head=6, seq=96, device="cpu")
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
