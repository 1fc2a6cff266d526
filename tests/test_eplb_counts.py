"""EPLB's token counts (engines/eplb_counts.py): MindSpeed-RL's per-rank file format both ways, how the ranks' files add
up for cli/eplb_generate_map_ds.py, the whole-file save, and the config keys' refusals.

Runs where: in-process (numpy, Hydra compose); ~3 s.
"""
import json
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from mindspeed_rl.config import ConfigError, load_config
from mindspeed_rl.engines.eplb_counts import (ExpertTokenCounts, aggregate_counts, counts_document, counts_files,
                                              read_counts_file)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def counts_of(tmp_path: Path, rank: int, **kwargs) -> ExpertTokenCounts:
    # Decoder layers 3 and 5 are MoE layers 1 and 2 (a stage after the first dense and MoE layers).
    return ExpertTokenCounts(save_dir=tmp_path, rank=rank, num_experts=4, moe_ordinal_of_layer={3: 1, 5: 2}, **kwargs)


def test_counts_are_saved_in_their_format_and_read_back(tmp_path):
    """2 tokens x top-2 on each layer: layer 1 routes to experts 0 1 and 0 3, layer 2 to 2 2 (a top-k of one expert
    twice is two routings, as theirs counts it) and 1 3. The file lists every expert, string keys, ascending."""
    counts = counts_of(tmp_path, rank=7)
    counts.add(np.array([[[0, 1], [2, 2]], [[0, 3], [1, 3]]]))
    path = counts.save()
    assert path == tmp_path / "eplb_token_collects_7.json"
    assert json.loads(path.read_text()) == {"1": {"0": 2, "1": 1, "2": 0, "3": 1}, "2": {"0": 0, "1": 1, "2": 2, "3": 1}}
    assert read_counts_file(path) == counts.as_layer_counts() == {1: {0: 2, 1: 1, 2: 0, 3: 1}, 2: {0: 0, 1: 1, 2: 2, 3: 1}}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the temporary file was renamed, none left


def test_a_file_already_there_is_added_to(tmp_path):
    """As MindSpeed-RL's collector does: a resumed or repeated run accumulates into the rank's file."""
    first = counts_of(tmp_path, rank=0)
    first.add(np.array([[[0, 1], [2, 3]]]))
    first.save()
    second = counts_of(tmp_path, rank=0)
    second.add(np.array([[[0, 0], [3, 3]]]))
    second.save()
    assert read_counts_file(second.path) == {1: {0: 3, 1: 1, 2: 0, 3: 0}, 2: {0: 0, 1: 0, 2: 1, 3: 3}}


def test_a_file_of_another_model_is_refused(tmp_path):
    (tmp_path / "eplb_token_collects_0.json").write_text(counts_document({1: {9: 5}}))
    with pytest.raises(ValueError, match="expert 9 in MoE layer 1, the model has 4 experts"):
        counts_of(tmp_path, rank=0)


def test_ranks_add_up_and_other_files_are_not_read(tmp_path):
    """Rank 0 (stage 0: MoE layer 0) and rank 2 (stage 1: layers 1, 2) give one [3 layers, 4 experts] matrix."""
    (tmp_path / "eplb_token_collects_0.json").write_text(counts_document({0: {0: 1, 1: 2, 2: 3, 3: 4}}))
    (tmp_path / "eplb_token_collects_2.json").write_text(counts_document({1: {0: 5, 1: 0, 2: 0, 3: 0},
                                                                           2: {0: 0, 1: 0, 2: 0, 3: 6}}))
    (tmp_path / "expert_map.json").write_text("{}")
    (tmp_path / ".eplb_token_collects_1.json.tmp-x").write_text("half a file")
    assert [p.name for p in counts_files(tmp_path)] == ["eplb_token_collects_0.json", "eplb_token_collects_2.json"]
    assert aggregate_counts(tmp_path).tolist() == [[1, 2, 3, 4], [5, 0, 0, 0], [0, 0, 0, 6]]


def test_a_malformed_file_is_named(tmp_path):
    (tmp_path / "eplb_token_collects_3.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="eplb_token_collects_3.json: not an EPLB token-count file"):
        aggregate_counts(tmp_path)


def load(config_name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return load_config(compose(config_name=config_name, overrides=list(overrides)))


def test_collecting_needs_a_save_path_and_a_moe_model(tmp_path):
    with pytest.raises(ConfigError, match=r"generate_config.eplb_token_save_path: is required with "
                                          r"eplb_token_collects: true"):
        load("grpo_tiny_moe_cpu", "++generate_config.eplb_token_collects=true")
    with pytest.raises(ConfigError, match=r"generate_config.eplb_token_collects: counts the tokens each MoE expert "
                                          r"receives; model.tiny_qwen2 has no MoE layers"):
        load("grpo_tiny_cpu", "++generate_config.eplb_token_collects=true",
             f"++generate_config.eplb_token_save_path={tmp_path}")
    config = load("grpo_tiny_moe_cpu", "++generate_config.eplb_token_collects=true",
                  f"++generate_config.eplb_token_save_path={tmp_path}")
    assert config.generate_config.eplb_token_collects and config.generate_config.eplb_token_save_path == str(tmp_path)
