"""Partial rollout in the colocated pool (MindSpeed-RL's rl_config.partial_rollout_max_split N and
require_max_age_all_finished; their docs/zh/features/partial_rollout.md, sync engine): the long tail stops setting
each iteration's pace.

Each iteration generates for a pool of prompt groups (the n samples of a prompt): the groups carried from earlier
iterations first, then new prompts from the sampler, up to two global batches (MindSpeed-RL's TransferDock holds two;
the last iteration draws none beyond one). A sample gets at most max_tokens // N response tokens per generate
(`chunk_tokens`); one that did not finish keeps its tokens, their log-probs and the policy version that sampled each,
and resumes in the next iteration from prompt + its tokens (vLLM re-prefills that prefix under the pushed weights),
with the budget it has left. Every unfinished sample of the pool gets one generate per iteration, and generates repeat
within the iteration until a global batch of groups is complete; the
complete groups train oldest first, one global batch of them, and every other group is carried. A group whose samples
reached the declared age (config/partial_rollout.max_token_age) trains now: with require_max_age_all_finished its
unfinished samples get their whole remaining budget, and without it their chunks alone reach max_tokens by then.
Trained tokens thus lag the policy by at most that age (the trainer checks it on every token, protocol.token_ages).

Run-ahead (rl_config.async_engine; MindSpeed-RL's asynchronous engine, verl's colocate_async): no chunks; the pool's
one generate (the next batch's prompts among it) stops at the decode step where a global batch of groups is complete
and none at the declared age is unfinished (engines/group_stop.py), the unfinished samples aborted with their tokens.

The carried groups and their samples are this object's state; a checkpoint keeps them (`state_dict`) with the
sampler, so that a resumed run generates what the uninterrupted one does. Evaluation generates whole samples.
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import torch

from mindspeed_rl.config import GRPOConfig
from mindspeed_rl.config.partial_rollout import POOL_BATCHES, chunk_tokens, max_token_age, runs_ahead
from mindspeed_rl.engines.group_stop import GroupStop
from mindspeed_rl.protocol import TOKEN_VERSIONS, Generation, RolloutBatch
from mindspeed_rl.trainer.rollout import PlainRollout, decode_occupancy, decode_slots, generated_samples, padded_rows
from mindspeed_rl.workers.actor_group import ActorGroup



@dataclass(kw_only=True)
class CarriedSample:
    """One sample's response so far: its tokens, vLLM's log-prob of each, and the policy version that sampled each, as
    packed arrays (int32, fp32 - the batch's own rollout_logprobs dtype -, int32): 12 B a token where Python lists
    would take 76 (at a 32k reasoning shape the carried samples are ~100M tokens)."""
    token_ids: array = field(default_factory=lambda: array("i"))
    logprobs: array = field(default_factory=lambda: array("f"))
    versions: array = field(default_factory=lambda: array("i"))
    done: bool = False

    def extend(self, generation: Generation, *, version: int, budget: int, max_tokens: int) -> None:
        self.token_ids.extend(generation.token_ids)
        self.logprobs.extend(generation.logprobs)
        self.versions.extend([version] * len(generation.token_ids))
        # vLLM says why it stopped; a generation that does not say is cut where it used its whole budget.
        stopped = generation.stopped if generation.stopped is not None else len(generation.token_ids) < budget
        self.done = stopped or len(self.token_ids) >= max_tokens

    def as_dict(self) -> dict:
        """JSON's lists (an fp32 value's shortest repr reads back bit-exact)."""
        return {"token_ids": self.token_ids.tolist(), "logprobs": self.logprobs.tolist(),
                "versions": self.versions.tolist(), "done": self.done}

    @classmethod
    def from_dict(cls, saved: dict) -> "CarriedSample":
        return cls(token_ids=array("i", saved["token_ids"]), logprobs=array("f", saved["logprobs"]),
                   versions=array("i", saved["versions"]), done=saved["done"])


@dataclass(kw_only=True)
class CarriedGroup:
    """The n samples of one prompt (its row in the training dataset), first generated in iteration `started`."""
    prompt_index: int
    started: int
    samples: list[CarriedSample]

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    def as_dict(self) -> dict:
        return {"prompt_index": self.prompt_index, "started": self.started,
                "samples": [sample.as_dict() for sample in self.samples]}

    @classmethod
    def from_dict(cls, saved: dict) -> "CarriedGroup":
        return cls(prompt_index=saved["prompt_index"], started=saved["started"],
                   samples=[CarriedSample.from_dict(s) for s in saved["samples"]])


class PartialRollout:
    """The rollout strategy of a run with partial_rollout_max_split > 1 (trainer/rollout_strategy.py). Training's
    rollouts come from `rollout` (it draws its own prompts: carried groups first); `generate` is evaluation's."""

    runs_ahead = False  # config/partial_rollout.py refuses one-step off-policy
    carries_samples = True

    def __init__(self, config: GRPOConfig):
        self.config = config
        self.plain = PlainRollout(config)
        self.max_tokens = config.generate_config.sampling_config.max_tokens
        self.chunk, self.max_age = chunk_tokens(config), max_token_age(config)
        self.run_ahead = runs_ahead(config)
        self.carried: list[CarriedGroup] = []

    def generate(self, actor_group: ActorGroup, prompt_ids: list[list[int]], *, iteration=None, n: int | None = None,
                 greedy: bool = False) -> tuple[RolloutBatch, dict]:
        """Whole samples (the evaluation's): nothing is cut or carried."""
        return self.plain.generate(actor_group, prompt_ids, iteration=iteration, n=n, greedy=greedy)

    def rollout(self, actor_group: ActorGroup, sampler, records: list, iteration: int, *,
                refill: int = 0) -> tuple[list, RolloutBatch, dict]:
        """Iteration `iteration`'s (prompt records, prompt-major batch, metrics): one global batch of complete groups,
        generated by the policy of version iteration - 1 and, for the carried groups' earlier tokens, older ones.
        `refill` > 0: dynamic sampling's further rollouts of the iteration (the groups it drops are not carried)."""
        gbs = self.config.megatron_training.global_batch_size
        last = iteration >= self.config.megatron_training.train_iters
        pool = self._pool(sampler, iteration, gbs * (1 if last else POOL_BATCHES))
        resumed = sum(1 for g in self.carried for s in g.samples if s.token_ids and not s.done)
        metrics = {"rollout/resumed_samples": resumed}
        rounds, timing, tokens, slots = 0, 0.0, 0, 0
        while self._needs_round(pool, iteration, rounds):
            round_metrics, (round_tokens, round_slots) = self._generate(actor_group, pool, records,
                                                                        (iteration, refill, rounds))
            timing += round_metrics.get("timing/rollout", 0.0)
            tokens, slots = tokens + round_tokens, slots + round_slots
            metrics = {**round_metrics, **metrics} if rounds == 0 else metrics
            rounds += 1
        trained = sorted((g for g in pool if g.complete), key=lambda g: g.started)[:gbs]  # stable: pool order
        self.carried = [g for g in pool if not any(g is t for t in trained)]
        assert not self._overdue(self.carried, iteration + 1, strictly=True), \
            f"partial rollout: a group carried into iteration {iteration + 1} would exceed the age {self.max_age}"
        metrics |= {"timing/rollout": timing, "rollout/partial_rounds": rounds,
                    "rollout/decode_occupancy": decode_occupancy(tokens, slots),
                    "rollout/carried_groups": len(self.carried),
                    "rollout/carried_samples_unfinished": sum(not s.done for g in self.carried for s in g.samples)}
        return [records[g.prompt_index] for g in trained], self._batch(trained, records, iteration), metrics

    def _pool(self, sampler, iteration: int, size: int) -> list[CarriedGroup]:
        """The carried groups, resumed first, then groups of new prompts from the sampler up to `size` groups."""
        n = self.config.rl_config.n_samples_per_prompt
        # A checkpoint of a run with a larger N may carry groups already past this run's bound: they cannot train.
        pool = [g for g in self.carried if iteration - g.started <= self.max_age]
        if len(pool) < len(self.carried):
            print(f"[partial rollout] dropped {len(self.carried) - len(pool)} carried group(s) older than this run's "
                  f"bound of {self.max_age} policy versions (rl_config.partial_rollout_max_split)", flush=True)
        while len(pool) < size:
            pool += [CarriedGroup(prompt_index=index, started=iteration, samples=[CarriedSample() for _ in range(n)])
                     for index in sampler.next_indices()]
        return pool

    def _needs_round(self, pool: list[CarriedGroup], iteration: int, rounds: int) -> bool:
        """Every unfinished sample gets at least one generate per iteration (so the longest finishes within its
        chunks' iterations); more while fewer than a global batch of groups is complete, or one at the declared age
        is not. Run-ahead: one, where the pool does not hold a trainable batch already (its stop keeps the bound)."""
        if all(g.complete for g in pool):
            return False
        gbs = self.config.megatron_training.global_batch_size
        short = sum(g.complete for g in pool) < gbs or self._overdue(pool, iteration)
        return short if self.run_ahead else rounds == 0 or short

    def _overdue(self, groups: list[CarriedGroup], iteration: int, *, strictly: bool = False) -> bool:
        """Whether a group at the declared age in `iteration` is not complete (`strictly`: one beyond it, at all)."""
        if strictly:
            return any(iteration - g.started > self.max_age for g in groups)
        return any(iteration - g.started >= self.max_age and not g.complete for g in groups)

    def _generate(self, actor_group: ActorGroup, pool: list[CarriedGroup], records: list,
                  key: tuple) -> tuple[dict, tuple[int, int]]:
        """One generate of every unfinished sample of the pool, each continuing from its prompt and tokens so far:
        its metrics and its (tokens, decode slots). `key` (iteration, refill, round): round r > 0 draws from its own
        seed stream, f(seed, iteration, refill, r)."""
        iteration = key[0]
        going = [(g, s) for g in pool for s in g.samples if not s.done]
        contexts = [list(records[g.prompt_index].token_ids) + s.token_ids.tolist() for g, s in going]
        budgets = [self._budget(g, s, iteration) for g, s in going]
        key = key if key[2] else key[:2]  # round 0: the iteration's (refill's) own stream
        started = time.perf_counter()
        actor_group.start_generate(contexts, key, n=1, max_tokens=budgets,
                                   stop=self._stop(pool, going, iteration) if self.run_ahead else None)
        results = actor_group.finish_generate()
        generated, metrics = generated_samples(results)
        for (_, sample), generation, budget in zip(going, generated, budgets, strict=True):
            sample.extend(generation, version=iteration - 1, budget=budget, max_tokens=self.max_tokens)
        metrics.setdefault("timing/rollout", time.perf_counter() - started)
        return metrics, decode_slots(results)

    def _stop(self, pool: list[CarriedGroup], going: list, iteration: int) -> GroupStop:
        """Run-ahead's stop: a global batch of groups complete, none at the declared age unfinished."""
        place = {id(g): i for i, g in enumerate(pool)}
        return GroupStop(sample_groups=tuple(place[id(g)] for g, _ in going), groups=len(pool),
                         target_groups=self.config.megatron_training.global_batch_size,
                         must_finish=tuple(i for i, g in enumerate(pool) if iteration - g.started >= self.max_age))

    def _budget(self, group: CarriedGroup, sample: CarriedSample, iteration: int) -> int:
        """The tokens this generate may add: a chunk, or (require_max_age_all_finished, at the declared age) the
        whole remaining budget; never past max_tokens."""
        left = self.max_tokens - len(sample.token_ids)
        at_max_age = iteration - group.started >= self.max_age
        if at_max_age and self.config.rl_config.require_max_age_all_finished:
            return left
        return min(self.chunk, left)

    def _batch(self, groups: list[CarriedGroup], records: list, iteration: int) -> RolloutBatch:
        samples = [(records[g.prompt_index].token_ids, s) for g in groups for s in g.samples]
        batch = RolloutBatch.from_token_lists([list(p) for p, _ in samples], [s.token_ids.tolist() for _, s in samples],
                                              pad_id=0, response_width=self.config.response_length_limit)
        batch.columns["rollout_logprobs"] = padded_rows([s.logprobs for _, s in samples], batch.response_logprobs_shape)
        versions = torch.full(batch.response_logprobs_shape, iteration - 1, dtype=torch.long)
        for row, (_, sample) in enumerate(samples):
            versions[row, : len(sample.versions)] = torch.tensor(sample.versions, dtype=torch.long)
        batch.columns[TOKEN_VERSIONS] = versions
        return batch

    def state_dict(self) -> dict:
        """The carried groups (tokens, log-probs, versions, the iteration each started), for the run checkpoint."""
        return {"groups": [g.as_dict() for g in self.carried]}

    def load_state_dict(self, state: dict) -> None:
        self.carried = [CarriedGroup.from_dict(g) for g in state["groups"]]
