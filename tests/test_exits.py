"""Clean exits: a finished multi-process run leaves through Python's normal shutdown with exit
code 0, and no process group is left for the interpreter's shutdown to free (where gloo's C++
teardown used to abort finished runs: docs/fault-tolerance.md, "Clean exits")."""

import re

from conftest import REPO, TINY, launch


def test_no_process_group_outlives_a_finished_run(tmp_path, data_cache):
    """4 ranks, pp 2 x tp 2: the world group, one per mesh dimension and the flattened dp group."""
    probe = str(REPO / "tests" / "exit_probe.py")  # runs the script through run_main, reports at exit
    flags = [*TINY, "--max_steps", "2", "--pp_size", "2", "--tp_size", "2", "--data_cache_dir", data_cache]
    result = launch(probe, ["train_hybrid.py", *flags, "--output_dir", str(tmp_path)], nproc=4)
    assert result.returncode == 0
    reports = re.findall(r"rank (\d): process groups alive at exit: (\d+) of (\d+)", result.stdout)
    assert sorted(int(rank) for rank, _, _ in reports) == [0, 1, 2, 3], result.stdout[-2000:]
    for rank, alive, created in reports:
        assert int(created) >= 4, f"rank {rank} made {created} groups: the probe missed the mesh's"
        assert alive == "0", f"rank {rank}: {alive} of {created} process groups left for the interpreter's shutdown"
