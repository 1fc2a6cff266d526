"""Tokenize a prompt dataset once: ``python cli/preprocess_data.py --config-name deepscaler [key=value ...]``.

MindSpeed-RL's preprocessing flow: the config (``configs/datasets/<name>.yaml``, Hydra override syntax
on the command line) names the ``input`` rows, the tokenizer, the template (``prompt_type``), the
field mapping (``map_keys``) and ``seq_length``; every prompt is rendered and tokenized with a progress
bar, prompts longer than ``seq_length`` tokens are dropped (count printed) or rejected, and the result
is written to ``output_prefix`` (a directory, atomically). Point ``megatron_training.data_path`` at it
and set ``megatron_training.prompt_type`` to the same template: the trainer then loads the token ids
without re-tokenizing.

Exit codes: 0 on success; 2 on a config error (one line ``config error: <key>: <message>`` on stderr),
including Hydra's (unknown config name, override of a key the file lacks, bad override syntax).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from mindspeed_rl.errors import ConfigError, error_lines
from mindspeed_rl.config.preprocess import PreprocessConfig, load_preprocess_config

CONFIG_ERROR_EXIT_CODE = 2
DATASETS_CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "datasets"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", required=True, help="a config of --config-dir, without .yaml")
    parser.add_argument("--config-dir", default=str(DATASETS_CONFIG_DIR), help="default: %(default)s")
    parser.add_argument("overrides", nargs="*", help="key=value (Hydra override syntax)")
    args = parser.parse_args(argv)
    try:
        config = load_preprocess_config(_compose(args.config_dir, args.config_name, args.overrides))
        preprocess(config)
    except ConfigError as error:
        print("\n".join(error_lines(error)), file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE
    return 0


def preprocess(config: PreprocessConfig) -> Path:
    """Tokenize ``config.input`` and write the dataset to ``config.output_prefix``; returns that directory."""
    from mindspeed_rl.data.dataset import DataKeys, load_prompt_dataset, save_prompt_dataset, tokenizer_fingerprint

    keys = DataKeys(data_path="input", prompt_type="prompt_type", map_keys="map_keys", max_prompt_length="seq_length",
                    overlong_prompts="overlong_prompts", tokenizer="tokenizer_name_or_path")
    tokenizer = _load_tokenizer(config.tokenizer_name_or_path)
    if config.is_pairwise_dataset:
        return _preprocess_pairs(config, tokenizer, keys)
    dataset = load_prompt_dataset(config.input, tokenizer=tokenizer, prompt_type=config.prompt_type,
                                  map_keys=config.map_keys, max_prompt_length=config.seq_length,
                                  overlong_prompts=config.overlong_prompts, show_progress=True, keys=keys)
    metadata = {
        "input": str(Path(config.input).resolve()),
        "tokenizer_name_or_path": str(Path(config.tokenizer_name_or_path).resolve()),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer, config.prompt_type),
        "prompt_type": config.prompt_type,
        "map_keys": dict(config.map_keys),
        "seq_length": config.seq_length,
    }
    output = save_prompt_dataset(dataset, config.output_prefix, metadata=metadata, key="output_prefix")
    print(f"[preprocess] {len(dataset.records)} prompts written to {output} ({dataset.num_filtered} longer than "
          f"seq_length={config.seq_length} dropped); train with megatron_training.data_path={output} "
          f"megatron_training.prompt_type={config.prompt_type}", flush=True)
    return output


def _preprocess_pairs(config: PreprocessConfig, tokenizer, keys) -> Path:
    """DPO's pairs (is_pairwise_dataset): prompt, chosen and rejected tokenized (data/preference.py)."""
    from mindspeed_rl.data.dataset import tokenizer_fingerprint
    from mindspeed_rl.data.preference import load_preference_dataset, save_preference_dataset

    dataset = load_preference_dataset(config.input, tokenizer=tokenizer, prompt_type=config.prompt_type,
                                      map_keys=config.map_keys, max_length=config.seq_length, keys=keys)
    metadata = {"input": str(Path(config.input).resolve()), "prompt_type": config.prompt_type,
                "tokenizer_name_or_path": str(Path(config.tokenizer_name_or_path).resolve()),
                "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer, config.prompt_type),
                "map_keys": dict(config.map_keys), "seq_length": config.seq_length}
    output = save_preference_dataset(dataset, config.output_prefix, metadata=metadata)
    print(f"[preprocess] {len(dataset.pairs)} preference pairs written to {output} ({dataset.num_filtered} longer "
          f"than seq_length={config.seq_length} dropped); train DPO with megatron_training.data_path={output} "
          f"megatron_training.is_pairwise_dataset=true", flush=True)
    return output


def _compose(config_dir: str, config_name: str, overrides: list[str]):
    if not Path(config_dir).is_dir():
        raise ConfigError("--config-dir", f"{config_dir} is not a directory")
    # Every key of the schema can be set whether the dataset's YAML lists it or not (Hydra's `++`); a key the schema
    # does not know is then reported by load_preprocess_config.
    overrides = [f"++{override}" if "=" in override and not override.startswith(("+", "~")) else override
                 for override in overrides]
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            return compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as error:
        # Hydra's messages name the config or the override, and the fix ("use +key=value") on a later
        # line: keep them all, on one line.
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
        key = "--config-name" if isinstance(error, MissingConfigException) else "overrides"
        raise ConfigError(key, message) from None


def _load_tokenizer(path: str):
    if not Path(path).exists():
        raise ConfigError("tokenizer_name_or_path", f"{path} does not exist")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # transformers raises OSError, ValueError, ... for an unusable directory
        text = str(error).strip()
        raise ConfigError("tokenizer_name_or_path",
                          f"{path}: cannot load a tokenizer ({text.splitlines()[0] if text else type(error).__name__})") from None


if __name__ == "__main__":
    sys.exit(main())
