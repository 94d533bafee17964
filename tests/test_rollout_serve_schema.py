"""serve's typed request models (rao_jax.rollout.serve.schema, openai_schema): defaults, type
and range checks whose errors name the field and the bad value, and what they resolve to.
Plain Python: no engine, no HTTP."""
import subprocess
import sys

import pytest

from rao_jax.rollout.base import SamplingParams
from rao_jax.rollout.serve.openai_schema import ChatIn, CompletionIn
from rao_jax.rollout.serve.schema import (AbortIn, BadRequest, GenerateIn, PauseIn,
                                          SamplingParamsIn, UpdateWeightsFromDiskIn,
                                          parse_generate, parse_sampling)

EOS = (2, 7)


class _Tok:
  """A character tokenizer: enough for text prompts (the schema only encodes)."""

  def encode(self, text):
    return [ord(c) % 100 for c in text]


def refused(fn, *args, **kwargs) -> BadRequest:
  with pytest.raises(BadRequest) as e:
    fn(*args, **kwargs)
  return e.value


def test_sampling_defaults_and_resolution():
  s = parse_sampling(None, EOS, True)
  assert s.params == SamplingParams(max_new_tokens=128, stop_token_ids=EOS)
  assert (s.n, s.max_new, s.min_new, s.stop_strs, s.no_stop_trim) == (1, 128, 0, (), False)
  s = parse_sampling({"temperature": 1e-7, "top_k": 5, "stop": "##", "stop_token_ids": [9],
                      "ignore_eos": True, "max_new_tokens": 4.0, "n": 2}, EOS, True)
  assert s.params.temperature == 0.0 and s.params.top_k == 5 and s.params.max_new_tokens == 4
  assert s.stop_strs == ("##",) and s.stop_ids == (9,) and s.n == 2
  # Scoring only: no engine params.
  assert parse_sampling({"max_new_tokens": 0}, EOS, True).params is None
  # The server's preferred defaults, overridden per request.
  s = parse_sampling({"top_p": 0.5}, EOS, True, preferred={"top_p": 0.9, "temperature": 0.3})
  assert (s.params.top_p, s.params.temperature) == (0.5, 0.3)


def test_min_new_tokens_goes_to_the_engine_with_the_stop_ids():
  s = parse_sampling({"min_new_tokens": 3, "max_new_tokens": 8, "stop_token_ids": [9]}, EOS,
                     True)
  # The engine masks the stop ids before 3 tokens (SamplingParams.min_new_tokens); the server
  # checks its stop strings from token 3 on.
  assert s.params.stop_token_ids == (9,) + EOS and s.params.min_new_tokens == 3
  assert s.stop_ids == (9,) + EOS and s.min_new == 3
  assert parse_sampling({"min_new_tokens": 8, "max_new_tokens": 8}, EOS, True).min_new == 8


@pytest.mark.parametrize("sp, field, words", [
    ({"temperature": "hot"}, "temperature", "'hot' must be a number"),
    ({"temperature": -1}, "temperature", "-1.0 must be >= 0"),
    ({"top_p": 0}, "top_p", "must be in (0, 1]"),
    ({"top_k": 0}, "top_k", "must be -1 (all) or >= 1"),
    ({"top_k": 2.5}, "top_k", "must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens", "must be an integer"),
    ({"max_new_tokens": -1}, "max_new_tokens", "must be >= 0"),
    ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens", "[0, max_new_tokens=8]"),
    ({"min_new_tokens": -1}, "min_new_tokens", "must be in [0"),
    ({"min_p": 2}, "min_p", "must be in [0, 1]"),
    ({"n": 0}, "n", "must be >= 1"),
    ({"stop": ["a", 3]}, "stop", "must be a string or a list of strings"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids", "token ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids", "a list of integers"),
    ({"ignore_eos": "yes"}, "ignore_eos", "true or false"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "(0, 2]"),
    ({"sampling_seed": "7"}, "sampling_seed", "an integer"),
    ({"custom_params": 3}, "custom_params", "an object"),
    ({"regex": "a+"}, "regex", "not supported"),
    ({"bogus": 1}, "bogus", "unknown sampling_params fields"),
])
def test_sampling_refusals_name_the_field_and_value(sp, field, words):
  e = refused(parse_sampling, sp, EOS, True)
  assert e.param == field, (e.param, str(e))
  assert field in str(e) and words in str(e), str(e)


def test_stop_strings_need_a_tokenizer():
  e = refused(parse_sampling, {"stop": "x"}, EOS, False)
  assert e.param == "stop" and "stop_token_ids" in str(e)


def test_generate_body_items_rids_and_refusals():
  items, as_list, stream = parse_generate(
      {"input_ids": [[5, 6], [7]], "sampling_params": {"n": 2, "sampling_seed": 10},
       "rid": ["a", "b"], "return_logprob": [True, False], "stream": True}, None, 100, EOS)
  assert as_list and stream
  assert [it.rid for it in items] == ["a_0", "a_1", "b_0", "b_1"]
  assert [it.prompt for it in items] == [[5, 6], [5, 6], [7], [7]]
  assert [it.params.seed for it in items] == [10, 11, 10, 11]
  assert [it.return_logprob for it in items] == [True, True, False, False]
  items, as_list, _ = parse_generate({"text": "hi", "rid": "r", "log_metrics": False,
                                      "session_params": {"id": "s"}}, _Tok(), 100, EOS)
  assert not as_list and items[0].prompt == [4, 5] and items[0].session_id == "s"
  for body, field in (({"input_ids": [1], "text": "a"}, "text"),
                      ({}, "text"),
                      ({"input_ids": [1, 200]}, "input_ids"),
                      ({"input_ids": [1], "stream": "yes"}, "stream"),
                      ({"input_ids": [1], "rid": 5}, "rid"),
                      ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
                      ({"input_ids": [[1], [2]], "lora_path": ["x"]}, "lora_path"),
                      ({"input_ids": [1], "return_text_in_logprobs": 1},
                       "return_text_in_logprobs"),
                      ({"input_ids": [1], "top_logprobs_num": 50, "return_logprob": True},
                       "top_logprobs_num"),
                      ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
                       "logprob_start_len"),
                      ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "n")):
    e = refused(parse_generate, body, None, 100, EOS)
    assert e.param == field, (body, e.param, str(e))
  assert refused(parse_generate, {"text": "a"}, None, 100, EOS).param == "text"   # no tokenizer
  assert refused(GenerateIn.from_json, [1, 2]).param == "request"


def test_admin_bodies():
  assert UpdateWeightsFromDiskIn.from_json({"model_path": "/w", "weight_version": 3,
                                            "flush_cache": True}).weight_version == 3
  assert refused(UpdateWeightsFromDiskIn.from_json, {}).param == "model_path"
  assert refused(UpdateWeightsFromDiskIn.from_json, {"model_path": 5}).param == "model_path"
  assert AbortIn.from_json({"abort_all": True}).abort_all
  assert refused(AbortIn.from_json, {}).param == "rid"
  assert PauseIn.from_json({}).mode == "abort"
  e = refused(PauseIn.from_json, {"mode": "later"})
  assert e.param == "mode" and "'later'" in str(e)


def test_openai_bodies_to_sampling():
  c = CompletionIn.from_json({"prompt": "hi", "temperature": 0, "stop": "x", "seed": 4,
                              "min_tokens": 2, "n": 2, "best_of": 2})
  assert c.sampling_json(500) == {"n": 2, "max_new_tokens": 16, "temperature": 0.0,
                                  "sampling_seed": 4, "min_new_tokens": 2, "stop": ["x"]}
  assert c.prompts() == ["hi"] and CompletionIn.from_json({"prompt": [1, 2]}).prompts() == [[1, 2]]
  ch = ChatIn.from_json({"messages": [{"role": "user", "content": [
      {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_completion_tokens": 5, "max_tokens": 9, "logprobs": True, "top_logprobs": 2})
  assert ch.messages == ({"role": "user", "content": "ab"},)
  assert ch.sampling_json(500)["max_new_tokens"] == 5
  assert ChatIn.from_json({"messages": [{"role": "user"}]}).sampling_json(500)[
      "max_new_tokens"] == 500
  for cls, body, field in (
      (CompletionIn, {"prompt": "a", "suffix": "b"}, "suffix"),
      (CompletionIn, {"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
      (CompletionIn, {"prompt": [1, "a"]}, "prompt"),
      (CompletionIn, {"prompt": "a", "logprobs": 30}, "logprobs"),
      (CompletionIn, {"prompt": "a", "max_tokens": "9"}, "max_tokens"),
      (CompletionIn, {"prompt": "a", "what": 1}, "what"),
      (ChatIn, {"messages": []}, "messages"),
      (ChatIn, {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
       "top_logprobs"),
      (ChatIn, {"messages": [{"role": "user", "content": "a"}], "echo": True}, "echo"),
      (ChatIn, {"messages": [{"role": "user", "content": "a"}], "tool_choice": "auto"},
       "tool_choice"),
      (ChatIn, {"messages": [{"role": "user", "content": "a"}],
                "response_format": {"type": "json_object"}}, "response_format")):
    e = refused(cls.from_json, body)
    assert e.param == field, (body, e.param, str(e))


def test_schema_loads_no_web_framework_or_jax():
  code = ("import sys, rao_jax.rollout.serve.schema, rao_jax.rollout.serve.openai_schema\n"
          "print(','.join(m for m in ('aiohttp', 'jax', 'flax') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       check=True).stdout.strip()
  assert out == ""


def test_sglang_output_shapes():
  from rao_jax.rollout.serve.schema import Done, Item, sglang_output, sglang_partial
  smp = parse_sampling({"max_new_tokens": 3}, EOS, True)
  it = Item(prompt=[5, 6], sampling=smp, params=smp.params, rid="r", return_logprob=True,
            logprob_start_len=1, top_logprobs_num=1, text_in_logprobs=True)
  d = Done(item=it, ids=[8, 2], logps=[-0.5, -0.25], finish={"type": "stop", "matched": 2},
           text="h", cached=1, version="3", latency=0.1, input_lps=[[-1.0, 6]],
           input_top=[[(-0.9, 4)]], output_top=[[(-0.5, 8)], [(-0.25, 2)]])
  out = sglang_output(d, lambda t: f"<{t}>", index=1)
  assert out["text"] == "h" and out["output_ids"] == [8, 2] and out["index"] == 1
  m = out["meta_info"]
  assert (m["id"], m["prompt_tokens"], m["completion_tokens"], m["cached_tokens"],
          m["weight_version"]) == ("r", 2, 2, 1, "3")
  assert m["output_token_logprobs"] == [[-0.5, 8, "<8>"], [-0.25, 2, "<2>"]]
  assert m["input_token_logprobs"] == [[-1.0, 6, "<6>"]]
  assert m["input_top_logprobs"] == [[[-0.9, 4, "<4>"]]]
  assert m["output_top_logprobs"][1] == [[-0.25, 2, "<2>"]]
  part = sglang_partial(it, [8], [-0.5], None, "3", str)
  assert "text" not in part and "index" not in part and part["meta_info"]["finish_reason"] is None
  assert part["meta_info"]["output_token_logprobs"] == [[-0.5, 8, "8"]]
