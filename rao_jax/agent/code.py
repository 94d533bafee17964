"""Extracting the code an agent wrote from its generated text."""
from __future__ import annotations

import ast
import re

# ```python ... ``` (also ```py / ```Python / bare ```); the closing fence may be missing when
# generation stopped at the token limit, in which case the block runs to the end of the text.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)",
                    re.DOTALL | re.IGNORECASE)


# Where a turn's generation stops (the engine's stop strings): a closing fence on its own line.
# A cell the model closes with its end-of-turn token (what it was taught) stops at that id
# first; this ends the cells that run on past the fence, at the newline after it. A bare
# opening fence at a line start ("\n```\n", no language) also matches: that turn then has no
# code, which the agent is told (NO_CODE), where the prompt asks for ```python blocks.
CELL_CLOSE_STOP = ("\n```\n",)


def extract_code(text: str) -> str | None:
  """The Python code of a turn: every fenced code block, joined in order; None if none.

  Args:
    text: the decoded generated text of one turn (reasoning plus code blocks).
  """
  blocks = [b.strip("\n") for b in _FENCE.findall(text)]
  blocks = [b for b in blocks if b.strip()]
  if not blocks:
    return None
  return "\n\n".join(blocks)


def syntax_error(code: str) -> str | None:
  """A short message when `code` does not parse as Python (top-level await allowed)."""
  try:
    compile(code, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
  except SyntaxError as e:
    line = (e.text or "").rstrip("\n")
    return f"SyntaxError: {e.msg} (line {e.lineno}){': ' + line if line else ''}"
  return None
