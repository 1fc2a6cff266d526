"""GRPO training: ``python cli/train_grpo.py [--config-name NAME] [key=value ...]``.

The default config is the Qwen2.5-7B recipe where an NPU/GPU is present, the tiny CPU demo elsewhere. Exit codes:
0 on success (also ``--help`` and ``--cfg job``, which only print); 2 on any config error, ours (one line
``config error: <key>: <message>`` on stderr) or Hydra's; otherwise whatever the run exits with. Overrides and
``--config-dir``: mindspeed_rl/trainer/launch.py.
"""
from mindspeed_rl.config import default_config_name
from mindspeed_rl.trainer.launch import launch

if __name__ == "__main__":
    launch("ray_grpo", default_config_name())
