"""A single-turn verifiers (v1) environment for sleuth's tests: add two numbers.

Two weighted rewards: `correct` (weight 1.0, the sum as the reply's last number) and `brief`
(weight 0.5, a reply of at most 8 characters). `broken_reward=true` makes `correct` raise. Written against verifiers' public v1 API only.
"""

import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int = 0
    broken: bool = False


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.broken:
            raise RuntimeError("this reward function is broken")
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len((trace.last_reply or "").strip()) <= 8)


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 40
    broken_reward: bool = False
    """Every task's `correct` raises (sleuth's tests of a failing environment)."""


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        return [SumTask(SumData(prompt=f"What is {i} + {2 * i % 7}? Reply with the number.", answer=i + 2 * i % 7,
                                broken=self.config.broken_reward),
                        self.config.task) for i in range(self.config.num_tasks)]


__all__ = ["SumTaskset"]
