"""Renders tree records as one self-contained HTML page.

    python -m rao_jax.agent.view TREES.jsonl -o page.html

Every tree is a collapsible block; inside, every node is a collapsible block nested under its
parent, showing its goal, each turn's code and observation, its final message, ending, success
signal (and source) and timings. Nodes are coloured by success (green 1, red 0, shades between,
grey unscored). No scripts or external assets: the page opens anywhere.
"""
from __future__ import annotations

import argparse
import html
import sys
from typing import Sequence

from rao_jax.agent import records as R

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; background: #fafafa; color: #222; }
details { margin: 0.3em 0 0.3em 1.2em; border-left: 4px solid var(--c); padding-left: 0.6em;
          background: #fff; }
summary { cursor: pointer; padding: 0.2em 0; }
summary .tag { font-size: 0.8em; padding: 0 0.4em; border-radius: 3px; background: var(--c);
               color: #fff; margin-right: 0.4em; }
pre { background: #f3f3f3; padding: 0.5em; overflow-x: auto; white-space: pre-wrap;
      font-size: 0.85em; margin: 0.2em 0; }
pre.obs { background: #eef4fb; }
.meta { color: #666; font-size: 0.85em; }
h1 { font-size: 1.3em; }
"""


def _colour(s: float | None) -> str:
  if s is None:
    return "#999"
  s = min(max(float(s), 0.0), 1.0)
  r, g = int(200 * (1 - s) + 30 * s), int(60 * (1 - s) + 150 * s)
  return f"rgb({r},{g},60)"


def _esc(x) -> str:
  return html.escape(str(x), quote=True)


def _node_html(tree: R.TreeRecord, node: R.NodeRecord, by_id: dict[str, R.NodeRecord]) -> str:
  s = node.success
  head = (f"<span class='tag'>{'?' if s is None else f'{s:.2f}'}</span>"
          f"<b>{_esc(node.node_id)}</b> depth {node.depth} &middot; {_esc(node.end_reason)} "
          f"&middot; {node.num_steps} turns &middot; {node.num_generated_tokens} tokens &middot; "
          f"{_esc(node.goal.splitlines()[0] if node.goal else '')[:160]}")
  parts = [f"<details style='--c:{_colour(s)}' {'open' if node.depth == 0 else ''}>",
           f"<summary>{head}</summary>",
           f"<div class='meta'>success {s!r} from {_esc(node.success_source)} &middot; "
           f"weight version {_esc(node.weight_version)} &middot; timings "
           + ", ".join(f"{_esc(k)} {v:.3f}s" for k, v in node.timings.items()
                       if isinstance(v, (int, float)))
           + "</div>",
           f"<div><b>Goal</b><pre>{_esc(node.goal)}</pre></div>"]
  for i, turn in enumerate(node.extras.get("turns", [])):
    code = turn.get("code")
    body = (f"<pre>{_esc(code)}</pre>" if code is not None
            else f"<pre>{_esc(turn.get('text', ''))}</pre>")
    obs = turn.get("observation")
    parts.append(f"<details style='--c:#bbb'><summary>turn {i + 1}</summary>{body}"
                 + (f"<pre class='obs'>{_esc(obs)}</pre>" if obs is not None else "")
                 + "</details>")
  if node.final_message:
    parts.append(f"<div><b>Final message</b><pre>{_esc(node.final_message)}</pre></div>")
  for key in ("error", "judge", "success_note"):
    if key in node.extras:
      parts.append(f"<div class='meta'><b>{key}</b> {_esc(node.extras[key])}</div>")
  for c in node.children:
    if c in by_id:
      parts.append(_node_html(tree, by_id[c], by_id))
  parts.append("</details>")
  return "\n".join(parts)


def render_html(trees: Sequence[R.TreeRecord], title: str = "RAO execution trees") -> str:
  """The page for `trees` (a string of HTML)."""
  out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_esc(title)}</title>"
         f"<style>{_CSS}</style></head><body><h1>{_esc(title)}</h1>"
         f"<p class='meta'>{len(trees)} trees, "
         f"{sum(len(t.nodes) for t in trees)} nodes</p>"]
  for t in trees:
    by_id = {n.node_id: n for n in t.nodes}
    root = t.nodes[0] if t.nodes else None
    s = root.success if root else None
    wall = t.meta.get("wall_s")
    out.append(f"<details style='--c:{_colour(s)}'><summary><span class='tag'>"
               f"{'?' if s is None else f'{s:.2f}'}</span><b>{_esc(t.tree_id)}</b> &middot; "
               f"{_esc(t.env)} &middot; task {_esc(t.task_id)} &middot; {len(t.nodes)} nodes"
               + (f" &middot; {wall:.2f}s" if isinstance(wall, (int, float)) else "")
               + f" &middot; {_esc(t.meta.get('mode', ''))}</summary>")
    if root is not None:
      out.append(_node_html(t, root, by_id))
    out.append("</details>")
  out.append("</body></html>")
  return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description="Render a tree-record JSONL file as an HTML page.")
  p.add_argument("trees", help="JSON lines written by records.save_trees_jsonl")
  p.add_argument("-o", "--output", default="trees.html", help="HTML file to write")
  p.add_argument("--limit", type=int, default=0, help="render only the first N trees (0: all)")
  args = p.parse_args(argv)
  trees = R.load_trees_jsonl(args.trees)
  if args.limit:
    trees = trees[:args.limit]
  with open(args.output, "w") as f:
    f.write(render_html(trees, title=args.trees))
  print(f"wrote {args.output} ({len(trees)} trees)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
