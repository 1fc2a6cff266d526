"""The driver's progress lines (trainer/phase_progress.py): a phase the driver waits on longer than
`runtime.progress_seconds` prints a line, and another every that many seconds, under its name; short phases,
calls it does not wait on and progress_seconds 0 print nothing.

Runs where: in process. The group is a stand-in whose calls sleep: what is tested is the wrapper's timing, the
real groups' calls are the e2e tests' (test_train_grpo_e2e checks the line in a real run)."""
import re
import time

import pytest

from mindspeed_rl.config import ConfigError
from mindspeed_rl.trainer.phase_progress import PhaseClock, ProgressReportingGroup
from mindspeed_rl.workers.actor_group import RankGroupBase
from mindspeed_rl.workers.rank_worker import compose
from mindspeed_rl.workers.roles import ALL_PARTS

LINE = re.compile(r"^\[progress\] iteration 3, (.+): \d+ s so far$")


class SleepingGroup(RankGroupBase):
    """The real parts' declarations (the names the console shows), calls that sleep."""

    worker_class = compose("", ALL_PARTS)

    def __init__(self, seconds: float):
        self.seconds, self.calls = seconds, []

    def call(self, method, *args, blocking=True, **kwargs):
        self.calls.append((method, blocking))
        time.sleep(self.seconds)
        return [{}]

    def start_generate(self, prompts, iteration=None):
        time.sleep(self.seconds)

    def finish_generate(self):
        time.sleep(self.seconds)
        return []

    def start_score(self, prompts, responses):
        pass  # a Ray group's returns at once

    def finish_score(self):
        time.sleep(self.seconds)
        return []

    def shutdown(self):
        return "shut down"


def _reporting(seconds_per_call: float, every_seconds: float) -> tuple[ProgressReportingGroup, list[str]]:
    lines: list[str] = []
    clock = PhaseClock(every_seconds=every_seconds, iteration=lambda: 3, print_line=lines.append)
    return ProgressReportingGroup(SleepingGroup(seconds_per_call), clock), lines


def test_a_long_phase_prints_a_line_per_interval_under_its_name():
    group, lines = _reporting(0.55, 0.1)
    group.call("compute_log_prob")
    group.start_generate([[1, 2]])
    group.stop_reporting()
    phases = [LINE.match(line).group(1) for line in lines]
    # 0.55 s in steps of 0.1 s: 5 lines each (polled every 0.025 s; one may fall either side on a loaded machine)
    assert 4 <= phases.count("old log-probs") <= 6 and 4 <= phases.count("generate") <= 6, lines
    assert phases == sorted(phases, key=["old log-probs", "generate"].index)


def test_short_phases_and_calls_the_driver_does_not_wait_on_print_nothing():
    group, lines = _reporting(0.05, 0.2)
    for _ in range(4):
        group.call("update")
    long_group, long_lines = _reporting(0.4, 0.1)
    long_group.call("update_critic", blocking=False)
    group.stop_reporting(), long_group.stop_reporting()
    assert lines == [] and long_lines == []
    assert long_group._group.calls == [("update_critic", False)]


def test_the_mismatch_ledgers_re_score_is_waited_for_under_its_declared_name():
    group, lines = _reporting(0.35, 0.1)
    group.start_score([[1, 2]], [[3]])
    group.finish_score()
    group.stop_reporting()
    assert lines and {LINE.match(line).group(1) for line in lines} == {"re-score"}, lines


def test_a_wait_inside_another_phase_is_reported_as_the_outer_one():
    lines: list[str] = []
    clock = PhaseClock(every_seconds=0.1, iteration=lambda: 3, print_line=lines.append)
    group = ProgressReportingGroup(SleepingGroup(0.35), clock)
    with clock.phase("checkpoint save"):
        group.call("save_checkpoint")
        group.call("export_hf")
    clock.close()
    assert lines and {LINE.match(line).group(1) for line in lines} == {"checkpoint save"}, lines


def test_zero_seconds_starts_no_thread_and_other_attributes_are_the_groups():
    group, lines = _reporting(0.3, 0)
    group.call("update")
    assert lines == [] and group._clock._thread is None
    assert group.shutdown() == "shut down"


def test_a_negative_interval_is_a_config_error():
    from tests.test_mindspeed_rl_recipes import load_tiny

    with pytest.raises(ConfigError, match=r"^runtime.progress_seconds: must be >= 0, got -1"):
        load_tiny("runtime.progress_seconds=-1")
