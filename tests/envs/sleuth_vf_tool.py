"""A multi-turn verifiers (v1) environment with a tool, for sleuth's tests: multiply with `multiply`.

The task's toolset serves one MCP tool, `multiply(a, b)`; the model calls it, reads the result and
answers. Rewards: `correct` (weight 1.0, the product as the final reply's last number) and
`used_tool` (weight 0.25, a tool call returned the product). Public verifiers v1 API only.
"""

import re

import verifiers.v1 as vf


class MultiplyToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two whole numbers."""
        return str(a * b)


class ProductData(vf.TaskData):
    answer: int = 0


class ProductTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ProductTask(vf.Task[ProductData, vf.State, ProductTaskConfig]):
    @classmethod
    def toolsets(cls, config: ProductTaskConfig) -> list[vf.Toolset]:
        return [MultiplyToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(any(str(m.content).strip() == str(self.data.answer) for m in trace.tool_messages))


class ProductConfig(vf.TasksetConfig):
    num_tasks: int = 12
    task: ProductTaskConfig = ProductTaskConfig()


class ProductTaskset(vf.Taskset[ProductTask, ProductConfig]):
    def load(self) -> list[ProductTask]:
        pairs = [(3 + i, 7 + 2 * i) for i in range(self.config.num_tasks)]
        return [ProductTask(ProductData(prompt=f"Use the multiply tool to compute {a} * {b}, then reply with the "
                                               "number.", answer=a * b), self.config.task) for a, b in pairs]


if __name__ == "__main__":
    MultiplyToolset.run()

__all__ = ["ProductTaskset"]
