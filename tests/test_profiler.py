"""MindSpeed-RL's `profiler_config` (config/profiler.py, workers/stage_profiler.py): their keys load and are checked
one line per key; the rank's profiler writes a trace and a table only for the chosen stages, ranks and iterations;
the forwarder does nothing more when profiling is off. The CLI run that writes exactly the expected files is
tests/test_train_grpo_e2e.py's two-iteration run (tests/profiler_checks.py), not a run of its own.

Runs where: in the pytest process (torch.profiler on CPU).
"""
import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from test_config import TINY, compose_cfg, config_error, load

from mindspeed_rl.config import load_config
from mindspeed_rl.config.profiler import STAGE_RPCS, STAGES, IntegratedProfilerConfig
from mindspeed_rl.workers.rank_worker import _forwarder
from mindspeed_rl.workers.stage_profiler import StageProfiler

P = "profiler_config.integrated"

# Their docs' two blocks (docs/zh/features/profiler.md: the full one, and the DPO one), verbatim.
THEIR_BLOCKS = [
    dict(profile=False, mstx=False, stage="all", profile_save_path="./profiler_data", profile_export_type="text",
         profile_step_start=1, profile_step_end=2, profile_level="level1", profile_with_memory=False,
         profile_record_shapes=False, profile_with_cpu=True, profile_with_npu=True, profile_with_module=False,
         profile_analysis=False, profile_ranks="all"),
    dict(profile=True, profile_save_path="./profiler_data", profile_export_type="text", profile_step_start=1,
         profile_step_end=2, profile_level="level1", profile_with_memory=False, profile_record_shapes=False,
         profile_with_cpu=True, profile_ranks="all"),
]


def _tree() -> dict:
    return OmegaConf.to_container(compose_cfg(TINY), resolve=False)


@pytest.mark.parametrize("block", THEIR_BLOCKS)
def test_their_documented_blocks_load(block):
    cfg = _tree()
    cfg["profiler_config"] = {"integrated": block}  # their block alone, as a recipe would carry it
    notices = []
    integrated = load_config(cfg, notices=notices).profiler_config.integrated
    assert integrated.profile is block["profile"] and integrated.stages == STAGES and integrated.ranks is None
    # level1 asks for an Ascend level: listed as having no effect, only when profiling is on.
    assert [n for n in notices if n.startswith(P)] == ([f"{P}.profile_level (the Ascend profiler's detail levels; "
                                                        "torch.profiler records every op of the chosen activities at "
                                                        "one level)"] if block["profile"] else [])


def test_the_demo_has_the_section_off_and_a_config_without_it_loads():
    assert load(TINY).profiling is False
    cfg = _tree()
    del cfg["profiler_config"]
    assert load_config(cfg).profiler_config is None


@pytest.mark.parametrize("override, key, expected", [
    ("stage=actor_train", "stage", "must be all, one of actor_generate"),
    ("stage=[actor_generate,bogus]", "stage", "or a list of them, got ['actor_generate', 'bogus']"),
    ("profile_step_end=1", "profile_step_end", "must be > profile_step_start=1 (iterations [start, end), end "
                                               "excluded), got 1"),
    ("profile_step_start=0", "profile_step_start", "must be >= 1"),
    ("profile_export_type=json", "profile_export_type", "must be one of text, db, got 'json'"),
    ("profile_level=level3", "profile_level", "must be one of level_none, level0, level1, level2, got 'level3'"),
    ("profile_ranks=some", "profile_ranks", "must be all or a list of ranks"),
    ("profile_with_cpu=maybe", "profile_with_cpu", "expected bool"),
])
def test_each_bad_value_is_one_line_naming_its_key(override, key, expected):
    message = config_error(TINY, f"{P}.{override}")
    assert message.startswith(f"{P}.{key}: ") and expected in message and "\n" not in message, message


def test_an_empty_save_path_is_their_default_and_refused_only_when_profiling():
    assert IntegratedProfilerConfig(profile=False, profile_save_path="").profile_save_path == ""
    message = config_error(TINY, f"{P}.profile=true", f"{P}.profile_save_path=''")
    assert message.startswith(f"{P}.profile_save_path: must name a directory when profile is true"), message


def test_an_unknown_key_is_still_an_error():
    message = config_error(TINY, f"+{P}.profile_freq=2")
    assert message.startswith(f"{P}.profile_freq: unknown key (valid keys of {P}: profile, mstx, stage"), message


def test_keys_without_a_torch_counterpart_are_listed_as_no_effect_when_profiling():
    on = IntegratedProfilerConfig(profile=True, profile_export_type="db", profile_level="level2", profile_analysis=True)
    assert [n.split(" ")[0] for n in on.notices()] == [f"{P}.profile_export_type", f"{P}.profile_level",
                                                       f"{P}.profile_analysis"]
    assert IntegratedProfilerConfig(profile_export_type="db", profile_analysis=True).notices() == []  # profile off
    assert IntegratedProfilerConfig(profile=True).notices() == []  # their defaults ask for nothing missing


def _profiler(tmp_path, rank=0, device_type="cpu", **keys) -> StageProfiler:
    settings = IntegratedProfilerConfig(profile=True, profile_save_path=str(tmp_path), **keys)
    return StageProfiler(settings, rank=rank, device_type=device_type)


def _work():
    return torch.randn(8, 8) @ torch.randn(8, 8)


def test_the_chosen_stage_in_range_writes_a_trace_and_a_table(tmp_path):
    profiler = _profiler(tmp_path, stage="actor_update", profile_step_start=2, profile_step_end=3, mstx=True,
                         profile_record_shapes=True, profile_with_memory=True)
    for iteration in (1, 2, 3):
        profiler.begin_iteration(iteration)
        for rpc in ("generate_sequences", "update"):
            with profiler.around(rpc):
                _work()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["actor_update_iter2.json", "actor_update_iter2.txt", "rank0"]
    events = json.loads((tmp_path / "rank0" / "actor_update_iter2.json").read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert "aten::mm" in names and "mstx/actor_update" in names  # the work, and mstx's range
    assert any(event.get("args", {}).get("Input Dims") for event in events if event.get("name") == "aten::mm")
    assert "aten::mm" in (tmp_path / "rank0" / "actor_update_iter2.txt").read_text()


def test_a_stage_run_twice_in_an_iteration_keeps_both(tmp_path):
    profiler = _profiler(tmp_path, stage=["actor_generate"])
    profiler.begin_iteration(1)
    for _ in range(2):
        with profiler.around("generate_sequences"):
            _work()
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == [
        "actor_generate_iter1.json", "actor_generate_iter1.txt", "actor_generate_iter1_2.json",
        "actor_generate_iter1_2.txt"]


@pytest.mark.parametrize("keys, rank, iteration", [
    (dict(profile_ranks=[1]), 0, 1),  # another rank listed
    (dict(), 0, None),  # not told the iteration (e.g. before the loop)
    (dict(profile=False), 0, 1),  # off
])
def test_nothing_is_written_off_the_chosen_ranks_iterations_or_when_off(tmp_path, keys, rank, iteration):
    settings = IntegratedProfilerConfig(**{"profile": True, "profile_save_path": str(tmp_path), **keys})
    profiler = StageProfiler(settings, rank=rank, device_type="cpu")
    profiler.iteration = iteration
    with profiler.around("update"):
        _work()
    assert list(tmp_path.iterdir()) == []


def test_every_stage_names_a_declared_rpc():
    from mindspeed_rl.workers.parts import declared_rpcs
    from mindspeed_rl.workers.roles import ALL_PARTS

    declared = {name for part in ALL_PARTS for name in declared_rpcs(part)}
    assert set(STAGE_RPCS.values()) <= declared


def test_the_forwarder_calls_the_part_alone_when_profiling_is_off():
    calls = []

    def update(batch, kl_coef):
        """The part's RPC."""
        calls.append((batch, kl_coef))
        return "done"

    forward = _forwarder("training", "update", update)
    rank = SimpleNamespace(stage_hooks=(), parts={"training": SimpleNamespace(update=update)})
    assert forward(rank, "batch", kl_coef=0.1) == "done" and calls == [("batch", 0.1)]


def test_every_member_of_a_composite_group_learns_the_iteration():
    """Disaggregated inference ranks and a critic on its own devices profile their stages too."""
    from mindspeed_rl.workers.actor_group import CompositeGroup, RankGroupBase

    told = []

    class Ranks(RankGroupBase):
        def __init__(self, name):
            self.name = name

        def call(self, method, *args):
            told.append((self.name, method, *args))

    class Composite(CompositeGroup):
        def __init__(self, *members):
            self.member_groups = members

    Composite(Composite(Ranks("train"), Ranks("infer")), Ranks("critic")).begin_iteration(4)
    assert told == [("train", "begin_iteration", 4), ("infer", "begin_iteration", 4), ("critic", "begin_iteration", 4)]
    told.clear()
    Ranks("colocated").begin_iteration(5)
    assert told == [("colocated", "begin_iteration", 5)]
