"""Multi-turn rollouts with tool calls (rl_config.multi_turn_enable; MindSpeed-RL's ReTool recipe).

A turn generates for every sample still going. Each sample's new text is then parsed for tool calls
(tool_parser_format); the calls run (the tools of tool_config_path, each bounded: tools/sandbox.py) and their
outputs, in the chat template's user turn, are appended to the sample, which goes on to the next turn. A sample
ends when its turn holds no valid call, after max_tool_calls tool turns, or when the tool turn would take its
response to max_total_response_length tokens (MindSpeed-RL's rules, tools/utils/tool_utils.process_response).

The tool outputs are part of the response (the policy reads them, the log-prob passes score them as context) but
were not sampled: the batch's `loss_mask` column is 0 there (protocol.LOSS_MASK), so no loss, KL, entropy or
advantage counts them, and `tool_call_num` holds each sample's tool turns (retool_reward's bonus reads it).

MindSpeed-RL steps vLLM request by request (its async_engine); here a turn is one batched generate of the samples
still going, over the inference ranks as any rollout. Each sample's turn depends only on its own context, so the
samples are alike; turn t > 0 draws from its own seed stream, f(seed, iteration, turn).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.protocol import LOSS_MASK, RolloutBatch
from mindspeed_rl.trainer.rollout import generated_samples
from mindspeed_rl.workers.actor_group import ActorGroup

TOOL_CALLS = "tool_call_num"  # MindSpeed-RL's column and metric name


@dataclass
class _Sample:
    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[float] = field(default_factory=list)  # 1.0 on generated tokens, 0.0 on tool outputs
    tool_calls: int = 0
    last_turn: list[int] = field(default_factory=list)

    def add_turn(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.response += token_ids
        self.logprobs += logprobs
        self.sampled += [1.0] * len(token_ids)
        self.last_turn = token_ids

    def add_tool_output(self, token_ids: list[int]) -> None:
        self.response += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.sampled += [0.0] * len(token_ids)
        self.tool_calls += 1


class ToolTurns:
    """The rollout strategy of a multi-turn run (trainer/rollout_strategy.py): the tools, built once from
    tool_config_path, and the driver's tokenizer (tool outputs become tokens here, so every inference rank continues
    from the same ids)."""

    runs_ahead = False  # each turn waits for the tools (config/multi_turn.py refuses async_generation_ratio 1)

    def __init__(self, config: GRPOConfig, tokenizer):
        from mindspeed_rl.tools.parser import TOOL_PARSERS
        from mindspeed_rl.tools.registry import load_tools

        self.config, self.tokenizer = config, tokenizer
        self.tools = load_tools(config.rl_config.tool_config_path)
        self.parser = TOOL_PARSERS[config.rl_config.tool_parser_format]()
        # Samples' tool calls run side by side, as many as the tools allow (their num_workers).
        workers = max([getattr(tool, "num_workers", 1) for tool in self.tools.values()] + [1])
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool-call")

    def generate(self, actor_group: ActorGroup, prompt_ids: list[list[int]], *, iteration=None, n: int | None = None,
                 greedy: bool = False) -> tuple[RolloutBatch, dict]:
        """`n` samples per prompt (default rl_config's), each run turn by turn; one prompt-major batch."""
        n = n or self.config.rl_config.n_samples_per_prompt
        samples = [_Sample(prompt=list(ids)) for ids in prompt_ids for _ in range(n)]
        metrics = self._turn(actor_group, samples, prompt_ids, n=n, iteration=iteration, greedy=greedy)
        going, tool_seconds = self._after_turn(samples)
        turns = 1
        while going:
            turn_metrics = self._turn(actor_group, going, [s.prompt + s.response for s in going], n=1,
                                      iteration=_turn_seed_key(iteration, turns), greedy=greedy,
                                      max_tokens=[self._budget(s) for s in going])
            metrics["timing/rollout"] = metrics.get("timing/rollout", 0.0) + turn_metrics.get("timing/rollout", 0.0)
            turns += 1
            going, seconds = self._after_turn(going)
            tool_seconds += seconds
        calls = torch.tensor([s.tool_calls for s in samples], dtype=torch.float32)
        metrics |= {f"{TOOL_CALLS}/mean": calls.mean().item(), f"{TOOL_CALLS}/max": calls.max().item(),
                    f"{TOOL_CALLS}/min": calls.min().item(), "multi_turn/turns": turns, "timing/tools": tool_seconds}
        return self._batch(samples, [ids for ids in prompt_ids for _ in range(n)]), metrics

    def _turn(self, actor_group: ActorGroup, samples: list[_Sample], contexts: list[list[int]], *, n: int, iteration,
              greedy: bool, max_tokens: list[int] | None = None) -> dict:
        """One batched generate; sample j of the turn is context j // n's (j % n)-th."""
        actor_group.start_generate(contexts, iteration, n=n, greedy=greedy, max_tokens=max_tokens)
        generated, metrics = generated_samples(actor_group.finish_generate())
        for sample, generation in zip(samples, generated, strict=True):
            sample.add_turn(list(generation.token_ids), list(generation.logprobs))
        return metrics

    def _budget(self, sample: _Sample) -> int:
        """A continuation's tokens: what max_total_response_length leaves, at most sampling_config.max_tokens."""
        left = self.config.rl_config.max_total_response_length - len(sample.response)
        return min(left, self.config.generate_config.sampling_config.max_tokens)

    def _after_turn(self, samples: list[_Sample]) -> tuple[list[_Sample], float]:
        """Each sample's tool turn, the samples side by side: (those that go on, seconds)."""
        started = time.perf_counter()
        outputs = list(self._pool.map(self._tool_output_ids, samples))
        going = []
        for sample, ids in zip(samples, outputs):
            if ids is not None:
                sample.add_tool_output(ids)
                going.append(sample)
        return going, time.perf_counter() - started

    def _tool_output_ids(self, sample: _Sample) -> list[int] | None:
        """The token ids of the sample's tool turn, or None when the sample ends here."""
        from mindspeed_rl.tools.turns import run_tool_calls, tool_turn_text

        rl = self.config.rl_config
        if len(sample.response) >= rl.max_total_response_length or sample.tool_calls >= rl.max_tool_calls:
            return None
        calls = self.parser.extract_tool_calls(self.tokenizer.decode(sample.last_turn, skip_special_tokens=False))
        if not calls:
            return None
        outputs = run_tool_calls(calls, self.tools, max_parallel_calls=rl.max_parallel_calls,
                                 max_length=rl.max_tool_response_length, truncate_side=rl.tool_response_truncate_side)
        if outputs is None:
            return None
        ids = self.tokenizer(tool_turn_text(outputs), add_special_tokens=False)["input_ids"]
        return None if len(sample.response) + len(ids) >= rl.max_total_response_length else list(ids)

    def _batch(self, samples: list[_Sample], prompts: list[list[int]]) -> RolloutBatch:
        batch = RolloutBatch.from_token_lists(prompts, [s.response for s in samples], pad_id=0,
                                              response_width=self.config.response_length_limit)
        rollout_logprobs, loss_mask = torch.zeros(batch.response_logprobs_shape), torch.zeros(batch.response_logprobs_shape)
        for row, sample in enumerate(samples):
            rollout_logprobs[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs)
            loss_mask[row, : len(sample.sampled)] = torch.tensor(sample.sampled)
        batch.columns.update({"rollout_logprobs": rollout_logprobs, LOSS_MASK: loss_mask,
                              TOOL_CALLS: torch.tensor([s.tool_calls for s in samples], dtype=torch.long)})
        return batch


def _turn_seed_key(iteration, turn: int):
    """Turn `turn`'s key for workers/actor_steps.sampling_seed: (iteration, refill, turn); None stays None (the
    running generator)."""
    if iteration is None:
        return None
    key = tuple(iteration) if isinstance(iteration, (tuple, list)) else (iteration, 0)
    return (*key, turn)


def with_tool_call_bonus(rewards, batch: RolloutBatch, rl):
    """retool_reward's tool-call bonus (MindSpeed-RL's retool_reward): a wrong answer (score < 0) gains 0.1 per
    tool turn, up to 0; the total moves by the verifier's weight times the change."""
    from mindspeed_rl.data.rewards import RuleRewards, retool_tool_call_bonus

    if "retool_reward" not in rewards.per_verifier:
        return rewards
    calls = batch.columns[TOOL_CALLS].tolist()
    before = rewards.per_verifier["retool_reward"]
    after = torch.tensor([retool_tool_call_bonus(score, n) for score, n in zip(before.tolist(), calls)],
                         dtype=torch.float32)
    weight = sum(w for name, w in zip(rl.verifier_function, rl.verifier_weight) if name == "retool_reward")
    total = (rewards.total.to(torch.float64) + weight * (after - before).to(torch.float64)).to(torch.float32)
    return RuleRewards(total=total, per_verifier={**rewards.per_verifier, "retool_reward": after})
