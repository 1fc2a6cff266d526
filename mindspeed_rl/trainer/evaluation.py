"""Evaluation during training: the held-out prompts of megatron_training.eval_data_path generated (the residency
table's generate phase, no update) and scored by the run's verifiers, after every `rl_config.eval_interval`-th
update and, with `eval_before_train`, once before the first.

Metrics (to metrics.jsonl, TensorBoard and the curves): `eval/<verifier>/mean`, `eval/accuracy` (the share of
correct samples), `eval/pass@1` and `eval/pass@<n>` (the unbiased estimator of Chen et al. 2021 over the n =
eval_n_samples samples of each prompt), `eval/maj@<n>` (the majority answer of the n samples is correct), `eval/response_length/mean`, `eval/prompts`, `eval/updates` (how many
updates the evaluated weights had) and `timing/eval`.
"""
from __future__ import annotations

import math
import time

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.data.dataset import PromptDataset
from mindspeed_rl.data.rewards import compute_rule_rewards, correct_answers, final_answer
from mindspeed_rl.trainer.multi_turn import with_tool_call_bonus
from mindspeed_rl.trainer.rollout import decode_responses, generate


def majority_is_correct(answers: list[str | None], correct: list[bool]) -> bool:
    """maj@k: whether the most common final answer among the k samples (exact strings; samples without an answer
    do not vote; a tie goes to the answer seen first) is a correct one."""
    votes: dict[str, int] = {}
    for answer in answers:
        if answer is not None:
            votes[answer] = votes.get(answer, 0) + 1
    if not votes:
        return False
    winner = max(votes, key=lambda a: (votes[a], -answers.index(a)))
    return correct[answers.index(winner)]


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, `correct` of them
    correct, is correct: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large Language Models Trained
    on Code", the unbiased estimator)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


class Evaluation:
    def __init__(self, config: GRPOConfig, tokenizer, actor_group, dataset: PromptDataset | None, tool_turns=None):
        self.config, self.tokenizer, self.actor_group, self.dataset = config, tokenizer, actor_group, dataset
        self.tool_turns = tool_turns  # multi-turn tool use: evaluated with the tools, as the policy is trained

    def due(self, updates: int) -> bool:
        """Whether the weights after `updates` updates are evaluated."""
        rl = self.config.rl_config
        if self.dataset is None:
            return False
        return (updates == 0 and rl.eval_before_train) or (rl.eval_interval > 0 and updates > 0
                                                           and updates % rl.eval_interval == 0)

    def run(self, updates: int) -> dict[str, float]:
        """Every held-out prompt, generated and scored; the eval/* metrics."""
        rl, started = self.config.rl_config, time.perf_counter()
        n = rl.eval_n_samples
        scores: dict[str, list[float]] = {name: [] for name in rl.verifier_function}
        correct_per_prompt, majority, lengths = [], [], []
        for prompts in self._chunks():
            batch, _ = generate(self.actor_group, prompts, self.config, n=n, greedy=rl.eval_sampling == "greedy",
                                tool_turns=self.tool_turns)
            responses = decode_responses(self.tokenizer, batch)
            labels = [p.label for p in prompts for _ in range(n)]
            rewards = compute_rule_rewards(responses, labels, rl.verifier_function, rl.verifier_weight,
                                           timeout_seconds=rl.verifier_timeout_seconds)
            if rl.multi_turn_enable:
                rewards = with_tool_call_bonus(rewards, batch, rl)
            for name, values in rewards.per_verifier.items():
                scores[name] += values.tolist()
            correct = correct_answers(responses, labels, rl.verifier_function)
            answers = [final_answer(r, rl.verifier_function) for r in responses]
            correct_per_prompt += [sum(correct[i:i + n]) for i in range(0, len(correct), n)]
            majority += [majority_is_correct(answers[i:i + n], correct[i:i + n]) for i in range(0, len(correct), n)]
            lengths += batch.response_mask.sum(dim=1).tolist()
        metrics = {f"eval/{name}/mean": sum(values) / len(values) for name, values in scores.items()}
        metrics["eval/accuracy"] = sum(correct_per_prompt) / (n * len(correct_per_prompt))
        for k in sorted({1, n}):
            metrics[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct_per_prompt) / len(correct_per_prompt)
        metrics[f"eval/maj@{n}"] = sum(majority) / len(majority)
        metrics |= {"eval/response_length/mean": sum(lengths) / len(lengths), "eval/prompts": len(correct_per_prompt),
                    "eval/updates": updates, "timing/eval": time.perf_counter() - started}
        return metrics

    def _chunks(self):
        """The prompts in rollouts of global_batch_size, each a multiple of the inference DP size (a remainder
        that cannot be split evenly is left out, and counted in eval/prompts)."""
        records, dp = self.dataset.records, self.config.infer_data_parallel_size
        per_rollout = max(dp, self.config.megatron_training.global_batch_size // dp * dp)
        usable = len(records) - len(records) % dp
        for start in range(0, usable, per_rollout):
            yield records[start:min(start + per_rollout, usable)]


def format_eval_line(metrics: dict) -> str:
    passes = " ".join(f"{k[5:]}={v:.3f}" for k, v in metrics.items() if k.startswith(("eval/pass@", "eval/maj@")))
    return (f"[eval after {int(metrics['eval/updates'])} updates] accuracy={metrics['eval/accuracy']:.3f} {passes} "
            f"resp_len={metrics['eval/response_length/mean']:.1f} prompts={int(metrics['eval/prompts'])} "
            f"time={metrics['timing/eval']:.2f}s")

