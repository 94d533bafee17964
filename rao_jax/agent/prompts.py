"""The agent's system prompt and the text of REPL observations."""
from __future__ import annotations

_INTRO = """\
You are an agent that solves a task by writing Python code. Your code runs in a persistent \
Python REPL: variables and imports stay between turns.
Each turn, think briefly, then write exactly one ```python code block. What it prints is \
shown to you in the next message. Call the tools below directly from your code.
"""

_FINISH = """\
- finish(message: str)
    Call it when the task is done (or cannot be done): it ends your work and `message` is \
your final answer, returned to whoever gave you the task.
"""

_RECURSIVE = """\
Helpers: `await launch_subagent(...)` starts a helper agent with a fresh context that runs \
the same way you do, and returns its final message. `asyncio` is imported: run independent \
helpers concurrently with `await asyncio.gather(...)`. Delegate parts of the task that are \
large and independent; do small parts yourself.
"""


def system_prompt(tool_docs: str, recursive: bool, depth: int, max_depth: int,
                  steps: int, budget: int, context_window: int) -> str:
  """The system prompt of one node.

  Args:
    tool_docs: the environment's tool documentation (`Environment.tool_docs`).
    recursive: whether `launch_subagent` is available (single-agent mode: False).
    depth: the node's depth (root 0).
    max_depth: deepest depth a helper may have.
    steps: the code turns this node may take.
    budget: the steps this node and all its helpers may take together.
    context_window: the node's context window in tokens.
  """
  parts = [_INTRO, tool_docs.rstrip("\n") + "\n" + _FINISH]
  can_launch = recursive and depth < max_depth
  if can_launch:
    parts.append(_RECURSIVE)
  limits = [f"you have at most {steps} turns", f"your context window is {context_window} tokens"]
  if can_launch:
    limits.append(f"your step budget (your turns plus your helpers' turns) is {budget}")
  if recursive:
    limits.append(f"you are at depth {depth}; helpers may go down to depth {max_depth}"
                  + ("" if can_launch else " (you cannot launch helpers)"))
  parts.append("Limits: " + "; ".join(limits) + ".\n")
  return "\n".join(parts)


def observation_text(output: str, error: str | None, steps_left: int, max_chars: int) -> str:
  """The user message that follows a turn: the cell's output, its error, the turns left."""
  text = output or ""
  if error:
    text = (text + "\n" if text else "") + error
  if not text.strip():
    text = "(no output)"
  if len(text) > max_chars:
    half = max_chars // 2
    text = (text[:half] + f"\n... [{len(text) - max_chars} characters cut] ...\n"
            + text[-half:])
  return f"{text.rstrip()}\n[turns left: {steps_left}]"


NO_CODE = ("No code block found. Write one ```python block per turn; call finish(message) "
           "when you are done.")
