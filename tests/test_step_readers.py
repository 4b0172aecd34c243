"""`StepReaders` (core/step_readers.py): monitors' reads wait for the skip guard's gather only with several ranks and
only while the guard has yet to read the step; the decider runs them in order, a later step drops stale ones. The
2-rank behaviour (one collective a step, a one-rank fault skipped everywhere) is tests/test_collectives_per_step.py;
here a single process stands in for a process group where noted."""

from __future__ import annotations

import pytest

from hf_stable.core import step_readers
from hf_stable.core.step_readers import StepReaders


class Decider:
    def __init__(self):
        self.judged = None

    def judges_later(self, step: int) -> bool:
        return self.judged != step


def test_one_process_reads_at_once():
    readers, decider = StepReaders(), Decider()
    readers.set_decider(decider)
    assert readers.defer(3, lambda: None, max_abs=True) is False  # no collective to save
    assert not readers.wants_max_abs(3)


@pytest.fixture
def two_ranks(monkeypatch):
    # a process group cannot be faked by a real component in one process: only the rank count is patched
    monkeypatch.setattr(step_readers, "is_distributed", lambda: True)


def test_reads_wait_for_the_decider_and_run_in_order(two_ranks):
    readers, decider, seen = StepReaders(), Decider(), []
    readers.set_decider(decider)
    assert readers.defer(3, lambda: seen.append("grad"), max_abs=True)
    assert readers.defer(3, lambda: seen.append("loss"))
    assert readers.wants_max_abs(3) and not readers.wants_max_abs(4)
    assert seen == []
    decider.judged = 3
    readers.flush(3)
    assert seen == ["grad", "loss"]
    readers.flush(3)  # each read runs once
    assert seen == ["grad", "loss"]
    assert readers.defer(3, lambda: seen.append("late")) is False  # the decider has read step 3: read now


def test_a_new_step_drops_reads_no_one_ran_and_no_decider_means_no_wait(two_ranks):
    readers, decider, seen = StepReaders(), Decider(), []
    readers.set_decider(decider)
    readers.defer(3, lambda: seen.append(3))
    readers.defer(4, lambda: seen.append(4))
    readers.flush(3)
    readers.flush(4)
    assert seen == [4]
    readers.set_decider(None)
    assert readers.defer(5, lambda: seen.append(5)) is False
