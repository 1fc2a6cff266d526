"""The preprocessing CLI's config (`configs/datasets/*.yaml`, MindSpeed-RL's key names where they exist).

``cli/preprocess_data.py`` reads ``input`` (a file or directory of rows), renders every prompt with
``prompt_type`` using the tokenizer at ``tokenizer_name_or_path``, drops (or rejects) prompts longer
than ``seq_length`` tokens and writes the token ids to ``output_prefix`` (a directory), which
``megatron_training.data_path`` then names.
"""

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from mindspeed_rl.config.checks import require_choice, require_positive
from mindspeed_rl.errors import ConfigError

PAIRWISE_HANDLER = "AlpacaStylePairwiseHandler"


@dataclass(kw_only=True)
class PreprocessConfig:
    # A .jsonl / .json / .parquet file or a directory of them.
    input: str
    # HF model directory whose tokenizer (and, for prompt_type=chat, chat template) is used.
    tokenizer_name_or_path: str
    # Output directory (written atomically; an earlier output there is replaced).
    output_prefix: str
    # A template of configs/prompt_templates.yaml, or `chat` for the tokenizer's own chat template.
    prompt_type: str = "empty"
    # Our field -> dotted path in a row: prompt and labels required, system optional; MindSpeed-RL's
    # spelling ({prompt, query: "", response, system: ""}) works too. No default: a default dict would be
    # merged into the user's, and its `labels` would then clash with MindSpeed-RL's `response`.
    map_keys: dict[str, str]
    # Prompts with more tokens (after the template) are dropped and counted, or rejected.
    seq_length: int
    overlong_prompts: str = "filter"
    # Rows of a prompt with `chosen` and `rejected` responses, for DPO (MindSpeed-RL's orca_rlhf.yaml; their handler
    # AlpacaStylePairwiseHandler): each pair is tokenized, those whose prompt + longer response exceed seq_length are
    # dropped (data/preference.py).
    is_pairwise_dataset: bool = False
    # MindSpeed-RL's data handler: the pairwise one implies is_pairwise_dataset; their prompt handlers are ours.
    handler_name: Optional[str] = None

    def __post_init__(self) -> None:
        from mindspeed_rl.registries import OVERLONG_CHOICES, check_prompt_type, resolve_map_keys

        for name in ("input", "tokenizer_name_or_path", "output_prefix"):
            if not getattr(self, name).strip():
                raise ConfigError(name, "must be a non-empty path")
        require_positive("", self, "seq_length")
        require_choice("", self, "overlong_prompts", OVERLONG_CHOICES)
        check_prompt_type(self.prompt_type, key="prompt_type")
        if self.handler_name == PAIRWISE_HANDLER:
            self.is_pairwise_dataset = True
        elif self.handler_name is not None and "Pairwise" in self.handler_name:
            raise ConfigError("handler_name", f"{self.handler_name!r}: the pairwise handler here is {PAIRWISE_HANDLER}")
        if not self.is_pairwise_dataset:  # a pair's fields are checked where its rows are read (data/preference.py)
            resolve_map_keys(self.map_keys, key="map_keys")


def load_preprocess_config(cfg: Union[DictConfig, Mapping[str, Any]]) -> PreprocessConfig:
    """Schema check (unknown keys, types, missing values) and validation; raises ConfigError only."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(PreprocessConfig), cfg)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "<root>"
        if isinstance(error, ConfigKeyError):
            valid = ", ".join(PreprocessConfig.__dataclass_fields__)
            raise ConfigError(key, f"unknown key (valid keys: {valid})") from None
        if isinstance(error, MissingMandatoryValue):
            raise ConfigError(key, "missing required value") from None
        if isinstance(error, ValidationError):
            raise ConfigError(key, str(error).splitlines()[0]) from None
        raise ConfigError(key, str(error).splitlines()[0] if str(error) else type(error).__name__) from None
    assert isinstance(config, PreprocessConfig)
    return config
