"""A fake ``perf_counter`` for the autotuners' decision tests: only the fake runner advances it."""

from __future__ import annotations


class FakeClock:
    """Each candidate "takes" ``cost[name]`` seconds when :meth:`tick` runs it; ``calls`` lists the order.
    Subclasses add ``run(name, call)`` returning what the candidate computes."""

    def __init__(self, cost: dict[str, float]):
        self.now = 0.0
        self.cost = cost
        self.calls: list[str] = []

    def perf_counter(self) -> float:
        return self.now

    def tick(self, name: str) -> None:
        self.calls.append(name)
        self.now += self.cost[name]
