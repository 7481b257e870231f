"""The multi-process launcher itself: a crash is never mistaken for a pass, a hung rank is
killed at one overall deadline, and the crashed rank's error is shown."""

import time

import pytest
from distributed import run_workers


def test_a_crashed_rank_and_a_hung_rank_fail_with_every_rank_stderr():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_workers("harness_worker.py", 2, [], timeout=5)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "did not finish within 5s" in message
    assert "rank 0: hung (killed at the deadline)" in message
    assert "rank 1: exit code 1" in message and "ValueError: rank 1 crashed on purpose" in message
    assert elapsed < 15  # one deadline for the job, not one per rank in turn


def test_results_report_each_rank_without_check():
    results = run_workers("harness_worker.py", 2, [], timeout=3, check=False)
    assert [r.returncode for r in results] == [None, 1]
    assert len(results[1].stdout) == 1_000_000
