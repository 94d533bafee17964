"""What a training loop does between steps, as hooks that run every n steps.

    hooks = [Hook("metrics", 1, write), Hook("eval", 25, evaluate), Hook("checkpoint", 10, save),
             progress_hook(total, initial, enabled)]
    for step in ...:
      metrics = await rl_step(...)
      await run_hooks(hooks, step, total, metrics)
    close_hooks(hooks)

A hook runs after step `step` (counted from 1) when `step` is a multiple of its `every`, and after
the last step of the run when `at_end` (so a run of 7 steps evaluating every 5 evaluates at 5 and
7). `every <= 0` turns it off. Hooks run in list order; one may raise to stop the loop.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Awaitable, Callable

HookFn = Callable[[int, dict[str, float]], "Awaitable[None] | None"]


@dataclasses.dataclass
class Hook:
  """``fn(step, metrics)`` after every `every`-th step (and after the last with `at_end`).

  Attributes:
    name: what it does (in errors and logs).
    every: steps between runs; <= 0 never runs it.
    fn: a function or coroutine function of (step, the step's metrics).
    at_end: also run after the run's last step.
    close: called once when the loop ends, however it ends (e.g. a progress bar's close).
  """
  name: str
  every: int
  fn: HookFn
  at_end: bool = True
  close: Callable[[], Any] | None = None

  def __post_init__(self):
    if not isinstance(self.every, int) or isinstance(self.every, bool):
      raise ValueError(f"Hook {self.name!r}: every={self.every!r} must be an integer (steps "
                       "between runs; 0 = never).")

  def due(self, step: int, total: int) -> bool:
    """Whether the hook runs after step `step` of a `total`-step run."""
    return self.every > 0 and (step % self.every == 0 or (self.at_end and step == total))


async def run_hooks(hooks: list[Hook], step: int, total: int, metrics: dict[str, float]) -> None:
  """Runs the hooks due after `step`, in order (awaiting the coroutine ones)."""
  for hook in hooks:
    if hook.due(step, total):
      out = hook.fn(step, metrics)
      if inspect.isawaitable(out):
        await out


def close_hooks(hooks: list[Hook]) -> None:
  """Each hook's `close`, in order."""
  for hook in hooks:
    if hook.close is not None:
      hook.close()


def progress_hook(total: int, initial: int, enabled: bool,
                  postfix: Callable[[dict[str, float]], dict[str, str]]) -> Hook:
  """A tqdm bar on stderr, one tick per step, with `postfix(metrics)` beside it."""
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top  (only loops that show one)
  bar = tqdm(total=total, initial=initial, desc="RAO", unit="step", disable=not enabled,
             dynamic_ncols=True)

  def tick(step: int, m: dict[str, float]) -> None:
    del step
    bar.update(1)
    bar.set_postfix(**postfix(m))

  return Hook("progress", 1, tick, close=bar.close)
