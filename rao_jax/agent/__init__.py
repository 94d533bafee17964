"""The recursive agent runtime.

Modules:
  runner      TreeRunner: grows execution trees (node loop, launch_subagent, limits, budgets,
              success chain verifier -> judge -> proxy); RunnerConfig.
  records     NodeRecord / TreeRecord: the tree schema (JSON lines) read by the learner.
  chat        token-level chat formatting (prompt ids, observation ids); ByteChatTokenizer.
  code        extracting the code block of a turn.
  prompts     the system prompt and observation text.
  policies    scripted TextCraft policy as an Engine; demonstrations for a warm start.
  local_exec  an in-process REPL pool for trusted scripted code (tests, benchmarks).
  view        `python -m rao_jax.agent.view TREES.jsonl -o page.html`.
"""
