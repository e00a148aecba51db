"""Processes of one machine calibrate one at a time: a second one waits and
takes the first one's figures, so every rank of a job prices plans alike
(autosac.core.cache.machine_lock, autosac.tools.calibrate.calibrate)."""

import os
import subprocess
import sys
import textwrap
import time

from autosac.core.cache import machine_lock

# a process that calibrates with a stand-in measurement: slow enough for the other to come while it
# runs, a figure of its own (its pid) so the test sees whose figures each process got
_CHILD = textwrap.dedent("""
    import os, sys, time
    from autosac.core.host import HostCosts
    from autosac.tools import calibrate as host

    def measure():
        with open(os.path.join(sys.argv[1], "measured"), "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.5)
        return HostCosts(op_us=float(os.getpid()), backward_op_us=8.0, backward_untimed_us=-1.0)  # every figure: cached

    host._measure = measure
    print(host.calibrate().op_us)
""")


def _spawn(cache_dir, tmp_path):
    env = {**os.environ, "AUTOSAC_CACHE_DIR": str(cache_dir)}
    env.pop("AUTOSAC_REMEASURE", None)
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_two_processes_calibrating_at_once_measure_once_and_agree(tmp_path):
    cache_dir = tmp_path / "cache"
    procs = [_spawn(cache_dir, tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    measured = (tmp_path / "measured").read_text().split()
    assert len(measured) == 1, measured  # the second process waited and read the first one's figures
    assert [float(out) for out, _ in outs] == [float(measured[0])] * 2


def test_a_lock_held_elsewhere_is_passed_over_after_its_timeout(tmp_path, monkeypatch):
    """Never a hang: a process still holding the lock (here another one, holding it
    for a minute) only delays the caller by the timeout, who then goes on unlocked."""
    monkeypatch.setenv("AUTOSAC_CACHE_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom autosac.core.cache import machine_lock\n"
         "with machine_lock('host-costs') as held:\n    print(held, flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"
        start = time.monotonic()
        with machine_lock("host-costs", timeout_s=0.5) as held:
            assert held is False
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with machine_lock("host-costs", timeout_s=5) as held:  # gone with its holder's process
        assert held is True


def test_without_a_disk_cache_nothing_is_locked(monkeypatch):
    monkeypatch.setenv("AUTOSAC_CACHE_DIR", "")
    with machine_lock("host-costs") as held:
        assert held is False


def test_a_cache_directory_that_cannot_be_made_is_no_lock_and_no_error(tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("AUTOSAC_CACHE_DIR", str(not_a_folder / "cache"))
    with machine_lock("host-costs") as held:
        assert held is False
