"""The agent's system prompt and the text of REPL observations."""
from __future__ import annotations

# Every token of the system prompt is paid for at every node: in prefill, in the context window
# and in the learner's rows (a 700-token prompt was half of a typical TextCraft node). So the
# prompt says each thing once, tersely; the tools' own docs say how to call them.
_INTRO = """\
Solve the task by writing Python in a persistent REPL. Each turn: one short thought, then one \
```python block; what it prints comes back to you. Call the tools directly.
"""

_FINISH = """\
- finish(message: str): ends your work (done, or impossible); `message` is your answer.
"""

_RECURSIVE = """\
`await launch_subagent(...)` runs a helper like you, with a fresh context, and returns its \
final message; run independent helpers at once with `await asyncio.gather(...)`. Delegate \
large independent parts; do small ones yourself.
"""


def can_launch(recursive: bool, depth: int, max_depth: int) -> bool:
  """Whether a node may launch helpers: recursive mode and above the depth limit."""
  return recursive and depth < max_depth


def system_prompt(tool_docs: str, recursive: bool, depth: int, max_depth: int,
                  steps: int, budget: int, context_window: int) -> str:
  """The system prompt of one node.

  At the depth limit nothing here offers helpers: the caller passes the environment's
  non-recursive tool docs (`Environment.tool_docs(can_launch(...))`), and the limits line says
  plainly that this agent works alone (a prompt that documented `launch_subagent` next to a
  line forbidding it contradicted itself).

  Args:
    tool_docs: the environment's tool documentation (`Environment.tool_docs`), non-recursive at
      the depth limit.
    recursive: whether the tree may launch helpers at all (single-agent mode: False).
    depth: the node's depth (root 0).
    max_depth: deepest depth a helper may have.
    steps: the code turns this node may take.
    budget: the steps this node and all its helpers may take together.
    context_window: the node's context window in tokens.
  """
  parts = [_INTRO, tool_docs.rstrip("\n") + "\n" + _FINISH]
  launch = can_launch(recursive, depth, max_depth)
  if launch:
    parts.append(_RECURSIVE)
  limits = [f"you have at most {steps} turns", f"your context window is {context_window} tokens"]
  if launch:
    limits.append(f"your step budget (your turns plus your helpers' turns) is {budget}")
    limits.append(f"you are at depth {depth}; helpers may go down to depth {max_depth}")
  elif recursive:
    limits.append(f"you are at depth {depth}, the deepest: you cannot launch helpers, do all "
                  "of your task yourself")
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
