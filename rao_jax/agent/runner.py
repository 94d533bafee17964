"""The recursive agent runtime: execution trees grown by the policy itself.

A node is an agent: a system prompt (the environment's tools, `launch_subagent` when allowed,
its limits, how to finish), its goal, then turns of generation -> extract the code block -> run
it in the node's REPL -> append the observation's tokens. `await launch_subagent(...)` in a
node's code starts a child node on the same engine, concurrently with its siblings when
gathered, and returns the child's final message to the parent's REPL.

Host-enforced limits (`RunnerConfig`):
  * depth: a node at `max_depth` is not offered helpers (its prompt has the environment's
    non-recursive tool docs) and gets an error string, not a child, if it calls
    `launch_subagent` anyway;
  * turns per agent: `max_steps_per_agent` own turns, then the node ends with "max_steps";
  * step budget: a tree has `task.max_steps` steps (turns, all nodes together), capped by
    `tree_step_budget` when set. A node's budget
    covers its own turns and its descendants'; launching a child moves the child's
    `num_steps` (capped to leave the parent one turn) from the parent's budget to the child's,
    and what the child did not use flows back when it ends. A node whose budget is spent ends
    with "budget";
  * live agents per tree: past `max_live_agents` running nodes, `launch_subagent` errors;
  * context window: a node whose tokens reach `context_window` ends with "context".
Failures are data: unparsable code, raising tools, timeouts and crashes become observations;
an aborted or failed generation ends the node with "error"; the tree always ends with a record.
A failure of the infrastructure rather than the agent (the engine failed or aborted, the sandbox
crashed or could not be set up) is also named in `extras["infra_error"]`, so the trainer can keep
it out of the baseline; an engine's device failure (`FinishReason.ERROR`) is named in
`extras["engine_error"]` too, and an engine that stopped serving for good (`EngineFailedError`)
in `extras["engine_failed"]`, which the trainer treats as fatal to the run. With a `deadline` (`run_tree` / `run_tasks`), every node of a tree past
it ends with "timeout" at its next turn boundary, a generation in flight is cut, and the node's
`extras["deadline"]` says so.

Trees of many tasks run concurrently on one event loop (`run_tasks`) and share the engine,
whose batching is what makes that fast. With `recursive=False` (single-agent mode) the tool is
not offered at all. At each launch the environment may judge whether the child's task lies
outside its root's or its parent's task (`Environment.subtask_scope`); the child's record keeps
that in `extras["scope"]`, a drift signal for training.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
import uuid
from typing import Any, Callable, Sequence

from rao_jax.agent import chat as chat_lib
from rao_jax.agent import code as code_lib
from rao_jax.agent import prompts
from rao_jax.agent import records as R
from rao_jax.envs import base
from rao_jax.rollout import base as rollout


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
  """Limits and sampling of the agent runtime.

  Attributes:
    recursive: offer `launch_subagent` (False: the single-agent baseline).
    max_depth: deepest depth a node may have (root 0); nodes at it cannot launch children.
    max_steps_per_agent: most turns (code cells) of one node.
    max_live_agents: most nodes of one tree running at once.
    context_window: tokens per node (prompt + generated + observations), 8192 in the paper's
      headline setting.
    max_new_tokens: most tokens generated per turn.
    min_turn_tokens: a node with fewer free context tokens than this ends with "context".
    temperature, top_p, top_k, seed: sampling (temperature 0 = greedy).
    observation_max_chars: longer observations are cut in the middle.
    node_timeout_s: wall-clock seconds per node (None: no limit); past it the node ends with
      "timeout" at its next turn boundary.
    tree_step_budget: most steps (turns, all nodes together) of one tree; a task's own
      `max_steps` is capped to it (None: the task's budget alone).
    stop_at_cell_close: a turn's generation ends where its code cell closes (the engine's
      stop strings, `code.CELL_CLOSE_STOP`), not at `max_new_tokens`: the cell is what runs,
      and text after it only costs decode time (and a parent's wait for its slowest child).
  """
  recursive: bool = True
  max_depth: int = 3
  max_steps_per_agent: int = 40
  max_live_agents: int = 64
  context_window: int = 8192
  max_new_tokens: int = 1024
  min_turn_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  seed: int | None = None
  observation_max_chars: int = 4000
  node_timeout_s: float | None = None
  tree_step_budget: int | None = None
  stop_at_cell_close: bool = True

  def __post_init__(self):
    for name in ("max_steps_per_agent", "max_live_agents", "context_window", "max_new_tokens",
                 "min_turn_tokens", "observation_max_chars"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"RunnerConfig.{name}={v!r}: must be an int >= 1.")
    if not isinstance(self.max_depth, int) or self.max_depth < 0:
      raise ValueError(f"RunnerConfig.max_depth={self.max_depth!r}: must be an int >= 0 "
                       "(0: the root cannot launch children).")
    if self.min_turn_tokens >= self.context_window:
      raise ValueError(f"RunnerConfig.min_turn_tokens={self.min_turn_tokens} must be below "
                       f"context_window={self.context_window}.")
    if self.node_timeout_s is not None and self.node_timeout_s <= 0:
      raise ValueError(f"RunnerConfig.node_timeout_s={self.node_timeout_s!r}: must be > 0 or None.")
    if self.tree_step_budget is not None and (
        isinstance(self.tree_step_budget, bool) or not isinstance(self.tree_step_budget, int)
        or self.tree_step_budget < 1):
      raise ValueError(f"RunnerConfig.tree_step_budget={self.tree_step_budget!r}: must be an int "
                       ">= 1 or None (the task's own max_steps).")
    rollout.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


class _Budget:
  """Steps left for a node and its descendants."""

  def __init__(self, steps: int):
    self.granted = steps
    self.left = steps


@dataclasses.dataclass
class _NodeState:
  info: base.NodeInfo
  rec: R.NodeRecord
  budget: _Budget
  own_cap: int
  finished: bool = False
  final_message: str = ""
  subtree_steps: int = 0
  child_counter: Any = dataclasses.field(default_factory=lambda: itertools.count(1))


class _Tree:
  def __init__(self, task: base.Task, episode: base.Episode, tree_id: str, group_id: str,
               deadline: float | None = None):
    self.task, self.episode = task, episode
    self.deadline = deadline   # time.perf_counter() past which every node is cut
    self.tree_id, self.group_id = tree_id, group_id
    self.records: list[R.NodeRecord] = []
    self.outcomes: dict[str, base.NodeOutcome] = {}
    self.live = 0
    self.children: set[asyncio.Task] = set()
    self.t0 = time.perf_counter()
    self.t0_unix = time.time()   # where the tree sits on a step's timeline

  def now(self) -> float:
    return time.perf_counter() - self.t0


class TreeRunner:
  """Runs execution trees of one environment on one engine.

  Args:
    env: the environment.
    engine: the rollout engine (model or scripted policy), shared by every node.
    tokenizer: encode/decode/stop_token_ids and a chat template (see `chat.ChatFormat`).
    repls: a REPL pool with `acquire()` / `release(repl)` (`sandbox_host.SandboxPool`, or
      `local_exec.LocalReplPool` for trusted scripted code).
    cfg: limits and sampling.
    judge: optional `base.Judge` for nodes no verifier covers.
  """

  def __init__(self, env: base.Environment, engine: rollout.Engine, tokenizer: Any, repls: Any,
               cfg: RunnerConfig = RunnerConfig(), judge: base.Judge | None = None):
    self.env, self.engine, self.tokenizer, self.repls = env, engine, tokenizer, repls
    self.cfg, self.judge = cfg, judge
    self.chat = chat_lib.ChatFormat(tokenizer)

  # -- public ------------------------------------------------------------------------------

  async def run_tasks(self, tasks: Sequence[base.Task], group_size: int = 1,
                      deadline: float | None = None,
                      on_tree: Callable[[R.TreeRecord], None] | None = None
                      ) -> list[R.TreeRecord]:
    """`group_size` trees of every task, all concurrently; results grouped by task in order.

    deadline: a `time.perf_counter()` time past which trees are cut (see `run_tree`).
    on_tree: called with each tree as it finishes (progress reports).
    """
    if group_size < 1:
      raise ValueError(f"group_size={group_size}: must be >= 1.")

    async def one(task, tree_id, group_id):
      tree = await self.run_tree(task, tree_id=tree_id, group_id=group_id, deadline=deadline)
      if on_tree is not None:
        on_tree(tree)
      return tree

    coros = []
    for task in tasks:
      gid = f"{task.task_id}/{uuid.uuid4().hex[:8]}"
      coros += [one(task, f"{gid}/{k}", gid) for k in range(group_size)]
    return list(await asyncio.gather(*coros))

  async def run_group(self, task: base.Task, group_size: int) -> list[R.TreeRecord]:
    """The K trees of one root task (they share a group id)."""
    return await self.run_tasks([task], group_size)

  async def run_tree(self, task: base.Task, tree_id: str | None = None,
                     group_id: str | None = None, deadline: float | None = None) -> R.TreeRecord:
    """Grows one tree from `task` and scores every node (verifier -> judge -> proxy).

    deadline: a `time.perf_counter()` time; past it every node ends with "timeout" at its next
      turn boundary and a generation in flight is cut (`meta["deadline_cut"]` is then True).
      The tree is scored as it stands.
    """
    tree_id = tree_id or f"{task.task_id}/{uuid.uuid4().hex[:8]}"
    tree = _Tree(task, self.env.new_episode(task), tree_id, group_id or tree_id, deadline)
    steps = task.max_steps
    if self.cfg.tree_step_budget is not None:
      steps = min(steps, self.cfg.tree_step_budget)
    info = base.NodeInfo(node_id="0", parent_id=None, depth=0, goal=task.goal,
                         fields=dict(task.fields), max_steps=steps,
                         can_launch=prompts.can_launch(self.cfg.recursive, 0, self.cfg.max_depth))
    await self._run_node(tree, info, _Budget(steps), variables={})
    # A root that ended while children it never awaited still run: stop them.
    pending = [t for t in tree.children if not t.done()]
    for t in pending:
      t.cancel()
    if pending:
      await asyncio.gather(*pending, return_exceptions=True)
    wall = tree.now()
    await self._score(tree)
    rec = R.TreeRecord(
        tree_id=tree_id, group_id=tree.group_id, task_id=task.task_id, env=self.env.name,
        nodes=tree.records,
        meta={"mode": "recursive" if self.cfg.recursive else "single", "wall_s": wall,
              "difficulty": task.difficulty, "goal": task.goal,
              "config": dataclasses.asdict(self.cfg), "episode": tree.episode.summary(),
              "step_budget": steps, "started_unix": tree.t0_unix,
              "deadline_cut": any("deadline" in r.extras for r in tree.records)})
    return rec

  # -- one node ----------------------------------------------------------------------------

  async def _run_node(self, tree: _Tree, info: base.NodeInfo, budget: _Budget,
                      variables: dict[str, Any], counted: bool = False,
                      extras: dict[str, Any] | None = None) -> base.NodeOutcome:
    """counted: the caller already counted this node in `tree.live` (launch_subagent).
    extras: recorded with the node from the start (the child's scope flags at launch)."""
    cfg = self.cfg
    rec = R.NodeRecord(node_id=info.node_id, parent_id=info.parent_id, depth=info.depth,
                       goal=info.goal, task_fields=_jsonable(dict(info.fields)),
                       timings={"start": tree.now(), "generate": 0.0, "execute": 0.0})
    rec.extras.update(extras or {})
    rec.extras["turns"] = []
    tree.records.append(rec)
    own_cap = min(cfg.max_steps_per_agent, budget.left)
    st = _NodeState(info=info, rec=rec, budget=budget, own_cap=own_cap)
    if not counted:
      tree.live += 1
    tree.episode.node_started(info)
    repl = None
    reason = R.END_ERROR
    try:
      # At the depth limit the environment's non-recursive docs: no helper is offered there.
      system = prompts.system_prompt(
          self.env.tool_docs(info.can_launch), cfg.recursive, info.depth, cfg.max_depth,
          own_cap, budget.left, cfg.context_window)
      ids = self.chat.prompt_ids(system, self.env.task_prompt(info))
      rec.token_ids.extend(ids)
      rec.gen_mask.extend([0] * len(ids))
      rec.logprobs.extend([0.0] * len(ids))
      repl = await self.repls.acquire()
      bound = {**self.env.node_variables(tree.episode, info), **variables}
      await repl.set_variables(bound)
      task_vars = [v for v in self.env.task_variables if v in bound]
      if task_vars:   # what drift_stats checks the node's code against
        rec.extras["task_vars"] = task_vars
      tools = dict(self.env.node_tools(tree.episode, info))
      tools["finish"] = self._finish_tool(st)
      if cfg.recursive:
        tools["launch_subagent"] = self._launch_tool(tree, st)
      reason = await self._turns(tree, st, repl, tools)
    except asyncio.CancelledError:
      reason = R.END_ERROR
      rec.extras["error"] = "cancelled: the tree ended before this node"
      raise
    except Exception as e:  # the tree always ends with a record
      reason = R.END_ERROR
      rec.extras["error"] = f"{type(e).__name__}: {e}"
      # Setting up the node (sandbox, tools, prompt) or the engine failed, not the agent.
      rec.extras["infra_error"] = rec.extras["error"]
    finally:
      tree.live -= 1
      if repl is not None:
        try:
          await self.repls.release(repl)
        except Exception as e:
          rec.extras["release_error"] = f"{type(e).__name__}: {e}"
      try:
        await self.engine.end_session(_session_id(tree, info))
      except Exception:
        pass
      rec.end_reason = reason
      rec.final_message = st.final_message if st.finished else ""
      rec.num_generated_tokens = sum(rec.gen_mask)
      rec.timings["end"] = tree.now()
      outcome = base.NodeOutcome(node=info, finished=st.finished, final_message=rec.final_message,
                                 end_reason=reason, steps_used=rec.num_steps,
                                 subtree_steps_used=budget.granted - budget.left)
      tree.outcomes[info.node_id] = outcome
      tree.episode.node_finished(outcome)
    return outcome

  async def _turns(self, tree: _Tree, st: _NodeState, repl: Any, tools: dict) -> str:
    cfg, rec = self.cfg, st.rec
    t_start = time.perf_counter()
    while True:
      if st.finished:
        return R.END_FINISH
      if rec.num_steps >= st.own_cap:
        return R.END_MAX_STEPS if st.own_cap == cfg.max_steps_per_agent else R.END_BUDGET
      if st.budget.left <= 0:
        return R.END_BUDGET
      room = cfg.context_window - len(rec.token_ids)
      if room < cfg.min_turn_tokens:
        return R.END_CONTEXT
      if cfg.node_timeout_s is not None and time.perf_counter() - t_start > cfg.node_timeout_s:
        return R.END_TIMEOUT
      if tree.deadline is not None and time.perf_counter() >= tree.deadline:
        rec.extras["deadline"] = "cut at a turn boundary"
        return R.END_TIMEOUT
      params = rollout.SamplingParams(
          temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
          max_new_tokens=min(cfg.max_new_tokens, room), seed=cfg.seed,
          stop_token_ids=tuple(self.chat.stop_token_ids),
          stop=code_lib.CELL_CLOSE_STOP if cfg.stop_at_cell_close else ())
      req = rollout.GenerateRequest(prompt_ids=list(rec.token_ids), params=params,
                                    session_id=_session_id(tree, st.info),
                                    context_limit=cfg.context_window,
                                    rid=f"{_session_id(tree, st.info)}/{rec.num_steps}")
      t0 = time.perf_counter()
      try:
        if tree.deadline is None:
          res = await self.engine.generate(req)
        else:
          res = await asyncio.wait_for(self.engine.generate(req),
                                       max(tree.deadline - time.perf_counter(), 0.0))
      except Exception as e:
        if (isinstance(e, asyncio.TimeoutError) and tree.deadline is not None
            and time.perf_counter() >= tree.deadline):
          rec.extras["deadline"] = "cut during a generation"
          return R.END_TIMEOUT
        rec.extras["error"] = rec.extras[R.INFRA_ERROR] = (
            f"generate failed: {type(e).__name__}: {e}")
        if isinstance(e, rollout.EngineFailedError):
          rec.extras[R.ENGINE_FAILED] = str(e)
        return R.END_ERROR
      t_gen_end = time.perf_counter()
      rec.timings["generate"] += t_gen_end - t0
      # Each turn's generation and cell on the tree's clock: a timeline shows what the agents
      # waited for.
      span = {"generate": [t0 - tree.t0, t_gen_end - tree.t0]}
      if len(res.logprobs) != len(res.token_ids):
        rec.extras["error"] = rec.extras["infra_error"] = (
            "engine returned logprobs and token_ids of different lengths")
        return R.END_ERROR
      if res.finish_reason == rollout.FinishReason.ERROR:
        # Before the output is kept: it came from device state the engine threw away.
        rec.extras["error"] = rec.extras[R.INFRA_ERROR] = rec.extras[R.ENGINE_ERROR] = (
            f"engine error: {res.message}")
        return R.END_ERROR
      if res.token_ids:
        rec.turn_starts.append(len(rec.token_ids))
        rec.token_ids.extend(int(t) for t in res.token_ids)
        rec.gen_mask.extend([1] * len(res.token_ids))
        rec.logprobs.extend(float(x) for x in res.logprobs)
      if rec.weight_version is None:
        rec.weight_version = res.weight_version
      elif res.weight_version != rec.weight_version:
        rec.extras.setdefault("weight_versions", []).append(res.weight_version)
      if res.finish_reason == rollout.FinishReason.ABORT:
        rec.extras["error"] = rec.extras["infra_error"] = f"generation aborted: {res.message}"
        return R.END_ERROR
      if not res.token_ids and res.finish_reason == rollout.FinishReason.CONTEXT:
        # The engine's own window (e.g. its cache length) is full before ours.
        rec.extras["context_note"] = res.message or "the engine's context limit was reached"
        return R.END_CONTEXT
      if not res.token_ids:
        rec.extras["error"] = rec.extras["infra_error"] = "engine generated no tokens"
        return R.END_ERROR
      rec.num_steps += 1
      st.budget.left -= 1
      text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
      if res.finish_reason == rollout.FinishReason.CONTEXT or len(rec.token_ids) >= cfg.context_window:
        rec.extras["turns"].append({"text": text, "code": None, "observation": None,
                                    "span_s": span})
        return R.END_CONTEXT
      code = code_lib.extract_code(text)
      output, error = "", None
      t1 = time.perf_counter()
      if code is None:
        error = prompts.NO_CODE
      else:
        error = code_lib.syntax_error(code)
        if error is None:
          r = await repl.run_cell(code, tools=tools)
          output, error = r.output, r.error
          if getattr(r, "crashed", False):
            rec.extras["error"] = rec.extras["infra_error"] = f"sandbox crashed: {error}"
            span["execute"] = [t1 - tree.t0, time.perf_counter() - tree.t0]
            rec.extras["turns"].append({"text": text, "code": code, "observation": error,
                                        "span_s": span})
            rec.timings["execute"] += time.perf_counter() - t1
            return R.END_ERROR
          if getattr(r, "sandbox_restarted", False):
            error = (error + "\n" if error else "") + (
                "The REPL was restarted: variables from earlier turns are gone.")
      rec.timings["execute"] += time.perf_counter() - t1
      steps_left = max(0, min(st.own_cap - rec.num_steps, st.budget.left))
      obs = prompts.observation_text(output, error, steps_left, cfg.observation_max_chars)
      span["execute"] = [t1 - tree.t0, time.perf_counter() - tree.t0]
      rec.extras["turns"].append({"text": text, "code": code, "observation": obs,
                                  "span_s": span})
      if st.finished:
        return R.END_FINISH
      closed = int(res.token_ids[-1]) in self.chat.stop_token_ids
      obs_ids = self.chat.observation_ids(obs, turn_closed=closed)
      if len(rec.token_ids) + len(obs_ids) + cfg.min_turn_tokens > cfg.context_window:
        return R.END_CONTEXT
      rec.token_ids.extend(obs_ids)
      rec.gen_mask.extend([0] * len(obs_ids))
      rec.logprobs.extend([0.0] * len(obs_ids))

  # -- tools the runtime owns --------------------------------------------------------------

  def _finish_tool(self, st: _NodeState):
    def finish(message: Any = "") -> str:
      if not st.finished:
        st.finished = True
        st.final_message = message if isinstance(message, str) else repr(message)
      return "Finished. Your final message was recorded."
    return finish

  def _launch_tool(self, tree: _Tree, st: _NodeState):
    cfg = self.cfg

    async def launch_subagent(*args, **kwargs) -> str:
      info = st.info
      if info.depth >= cfg.max_depth:
        return (f"Error: maximum depth {cfg.max_depth} reached; you cannot launch helpers. "
                "Do this part yourself.")
      if st.finished:
        return "Error: you already called finish(...)."
      try:
        spec = self.env.child_spec(tree.episode, info, tuple(args), dict(kwargs))
      except base.SubagentArgError as e:
        return f"Error: {e}"
      if tree.live >= cfg.max_live_agents:
        return (f"Error: {cfg.max_live_agents} agents are already running in this tree; "
                "wait for some to finish or do this part yourself.")
      # Keep one step for the parent so it can still act on the result.
      available = st.budget.left - 1
      want = spec.num_steps if spec.num_steps is not None else available
      grant = min(want, available)
      if grant < 1:
        return f"Error: not enough steps left to launch a helper ({st.budget.left} left)."
      st.budget.left -= grant
      child_budget = _Budget(grant)
      child_id = f"{info.node_id}.{next(st.child_counter)}"
      st.rec.children.append(child_id)
      child_info = base.NodeInfo(
          node_id=child_id, parent_id=info.node_id, depth=info.depth + 1, goal=spec.goal,
          fields=dict(spec.fields), max_steps=grant,
          can_launch=prompts.can_launch(cfg.recursive, info.depth + 1, cfg.max_depth))
      extras = {}
      try:
        scope = self.env.subtask_scope(tree.episode, info, spec)
      except Exception as e:   # a drift signal must never cost the agent its helper
        extras["scope_error"] = f"{type(e).__name__}: {e}"
      else:
        if scope is not None:
          extras["scope"] = _jsonable(dict(scope))
      # Counted here, not when the task first runs: launches gathered in one loop iteration
      # would otherwise all pass the check above before any of them counted itself.
      tree.live += 1
      task = asyncio.ensure_future(self._run_node(tree, child_info, child_budget,
                                                  dict(spec.variables), counted=True,
                                                  extras=extras))
      tree.children.add(task)
      try:
        outcome = await asyncio.shield(task)
      finally:
        if task.done() and not task.cancelled():
          st.budget.left += child_budget.left   # unused steps flow back
      return self.env.format_child_result(tree.episode, spec, outcome)

    return launch_subagent

  # -- success signals ---------------------------------------------------------------------

  async def _score(self, tree: _Tree) -> None:
    """s(v) for every node: verifier -> judge -> proxy (root success), with the source."""
    ep = tree.episode
    to_judge = []
    for rec in tree.records:
      out = tree.outcomes.get(rec.node_id)
      if out is None:
        continue
      try:
        s = (self.env.verify_root(ep, out) if rec.parent_id is None
             else self.env.verify_subtask(ep, out))
      except Exception as e:
        rec.extras["verifier_error"] = f"{type(e).__name__}: {e}"
        s = None
      if s is not None:
        rec.success, rec.success_source = float(s), R.SOURCE_VERIFIER
      elif self.judge is not None:
        to_judge.append((rec, out))
    if to_judge:
      verdicts = await asyncio.gather(
          *(self.judge(base.JudgeRequest(env=self.env.name, task=tree.task, node=out.node,
                                         answer=out.final_message, end_reason=out.end_reason))
            for _, out in to_judge), return_exceptions=True)
      for (rec, _), v in zip(to_judge, verdicts):
        if isinstance(v, BaseException):
          rec.extras["judge"] = {"error": f"{type(v).__name__}: {v}"}
          continue
        rec.extras["judge"] = _jsonable(dict(v.log))
        if v.score is not None:
          rec.success, rec.success_source = float(v.score), R.SOURCE_JUDGE
    root = tree.records[0]
    if root.success is None:
      # No verifier and no judge for the root: nothing is known, count it as a failure.
      root.success, root.success_source = 0.0, R.SOURCE_PROXY
      root.extras["success_note"] = "no verifier or judge decided the root"
    for rec in tree.records[1:]:
      if rec.success is None:
        rec.success, rec.success_source = root.success, R.SOURCE_PROXY


def _session_id(tree: _Tree, info: base.NodeInfo) -> str:
  return f"{tree.tree_id}/{info.node_id}"


def _jsonable(x: Any) -> Any:
  """A JSON-serialisable copy (tuples -> lists, unknown objects -> repr)."""
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (str, int, float, bool)) or x is None:
    return x
  return repr(x)
