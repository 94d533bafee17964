"""Tree record schema: round trip through JSON lines and validation."""
import pytest

from rao_jax.agent import records as R


def _tree():
  root = R.NodeRecord(node_id="0", parent_id=None, depth=0, goal="g", children=["0.1"],
                      token_ids=[1, 2, 3, 4], gen_mask=[0, 1, 1, 0], logprobs=[0.0, -0.5, -0.25, 0.0],
                      turn_starts=[1], final_message="done", end_reason="finish", success=1.0,
                      success_source="verifier", weight_version=3, num_generated_tokens=2,
                      num_steps=1, timings={"start": 0.0, "end": 1.5})
  child = R.NodeRecord(node_id="0.1", parent_id="0", depth=1, goal="c", token_ids=[5, 6],
                       gen_mask=[0, 1], logprobs=[0.0, -1.0], turn_starts=[1],
                       end_reason="max_steps", success=0.0, success_source="proxy",
                       num_generated_tokens=1, task_fields={"targets": {"a": 1}})
  return R.TreeRecord(tree_id="t0", group_id="g0", task_id="x", env="textcraft",
                      nodes=[root, child], meta={"mode": "recursive"})


def test_roundtrip_jsonl(tmp_path):
  trees = [_tree(), _tree()]
  trees[1].tree_id = "t1"
  p = tmp_path / "trees.jsonl"
  R.save_trees_jsonl(str(p), trees)
  back = R.load_trees_jsonl(str(p))
  assert [t.to_dict() for t in back] == [t.to_dict() for t in trees]
  back[0].validate()
  assert back[0].node("0.1").task_fields == {"targets": {"a": 1}}
  assert R.TreeRecord.from_json(trees[0].to_dict()).to_json() == trees[0].to_json()


def test_validate_catches_bad_records():
  t = _tree()
  t.nodes[1].gen_mask = [1, 1]
  with pytest.raises(ValueError, match="num_generated_tokens"):
    t.validate()
  t = _tree()
  t.nodes[0].logprobs = [0.0]
  with pytest.raises(ValueError, match="equal lengths"):
    t.validate()
  t = _tree()
  t.nodes[1].parent_id = "zzz"
  with pytest.raises(ValueError, match="child link"):
    t.validate()
  t = _tree()
  t.nodes[0].success_source = "oracle"
  with pytest.raises(ValueError, match="success_source"):
    t.validate()
