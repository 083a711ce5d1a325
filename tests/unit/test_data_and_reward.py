"""Your prompts, your tokenizer, your reward, without Ray: JSONL and Parquet files, text and chat
prompts, long prompts dropped or refused, the order a seed and a cursor give, every bad input named
(file, row or function), the built-in rewards, a reward function by module or file path, and the
responses decoded and cut at EOS or a stop string."""

import json
import math

import pytest
import torch

from chatlearn_mem import ConfigError
from chatlearn_mem_ray.inputs.data import DataConfig, DataError, PromptData, load_tokenizer, read_rows
from chatlearn_mem_ray.inputs.rewards import (
    RewardConfigError,
    RewardError,
    exact_match,
    final_answer,
    load_reward_function,
    math_answer,
    score,
)
from chatlearn_mem_ray.inputs.text_task import position_reward, write_task, write_tokenizer
from chatlearn_mem_ray.loops.grpo.loop import decode_responses, response_mask

pytest.importorskip("transformers")
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return load_tokenizer(d, vocab_size=64)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_tok")
    write_tokenizer(d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return load_tokenizer(d)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(tokenizer, *files, **cfg):
    return PromptData(DataConfig(train_files=list(files), **cfg), tokenizer)


# -- data -----------------------------------------------------------------------------------
def test_jsonl_and_parquet_rows_with_their_fields(tokenizer, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": "ab=", "answer": "ba"}, {"prompt": "abc=", "answer": "cba"}])
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "dd=", "answer": "dd", "level": 3}]), b)
    data = _data(tokenizer, a, b)
    assert [p.text for p in data.prompts] == ["ab=", "abc=", "dd="]
    assert data.prompts[2].fields == {"answer": "dd", "level": 3}
    assert data.fields == ["answer"]  # what every row has beside the prompt: the reward's fields
    assert data.prompts[1].tokens == tuple(tokenizer.encode("abc=", add_special_tokens=False))
    assert read_rows(b) == [{"prompt": "dd=", "answer": "dd", "level": 3}]


def test_chat_messages_are_rendered_with_the_tokenizers_template(chat_tokenizer, tokenizer, tmp_path):
    messages = [{"role": "system", "content": "be"}, {"role": "user", "content": "ab="}]
    f = _jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "ba"}])
    [p] = _data(chat_tokenizer, f, max_prompt_tokens=32).prompts
    assert p.text == "<s>be<u>ab=<a>"  # the template's rendering, the generation prompt added
    with pytest.raises(DataError, match="chat messages, and the tokenizer has no chat template"):
        _data(tokenizer, f, max_prompt_tokens=32)


def test_long_prompts_are_dropped_and_counted_or_refused(tokenizer, tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ab="}, {"prompt": "abcdefgh="}, {"prompt": "cd="}])
    data = _data(tokenizer, f, max_prompt_tokens=4)
    assert [p.text for p in data.prompts] == ["ab=", "cd="] and data.dropped == 1
    with pytest.raises(DataError, match=r"p.jsonl, row 2: the prompt has 9 tokens, more than data.max_prompt_tokens=4"):
        _data(tokenizer, f, max_prompt_tokens=4, too_long="error")
    with pytest.raises(DataError, match="no prompt is left: all 3 row"):
        _data(tokenizer, f, max_prompt_tokens=2)


@pytest.mark.parametrize(
    "rows, said",
    [
        ([{"question": "ab="}], "row 1 has no field 'prompt' (data.prompt_key); its fields: question"),
        ([{"prompt": "ab="}, {"prompt": 42}], "row 2: the prompt ('prompt') must be text or a list of chat messages"),
        ([{"prompt": [{"role": "user"}]}], "row 1: the prompt ('prompt') must be text or a list of chat messages"),
        ([], "has no rows"),
    ],
)
def test_bad_rows_are_named(tokenizer, tmp_path, rows, said):
    f = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=said.replace("(", r"\(").replace(")", r"\)")) as e:
        _data(tokenizer, f)
    assert str(f) in str(e.value) and isinstance(e.value, ConfigError)


def test_bad_files_and_tokenizers_are_named(tokenizer, tmp_path):
    with pytest.raises(DataError, match="missing.jsonl does not exist"):
        _data(tokenizer, tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("prompt\nab=\n")
    with pytest.raises(DataError, match="neither .jsonl nor .parquet"):
        _data(tokenizer, tmp_path / "p.csv")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "ab="}\nnot json\n')
    with pytest.raises(DataError, match="broken.jsonl, line 2: not JSON"):
        _data(tokenizer, tmp_path / "broken.jsonl")
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(DataError, match="no_tokenizer holds no tokenizer .*it has config.json"):
        load_tokenizer(empty)
    with pytest.raises(DataError, match="44 tokens, more than policy.vocab_size=32"):
        load_tokenizer(tokenizer.name_or_path, vocab_size=32)


def test_the_order_is_the_seeds_and_a_cursor_continues_it_across_epochs(tokenizer, tmp_path):
    f = tmp_path / "r.jsonl"
    write_task("reverse", f, rows=10)
    data = _data(tokenizer, f, seed=3)
    first, cursor = data.batch(4)
    second, cursor = data.batch(4, cursor)
    third, cursor = data.batch(4, cursor)  # 2 of epoch 0, 2 of epoch 1
    assert cursor == {"epoch": 1, "row": 2}
    epoch0 = [data.prompts[i] for i in data.order(0)]
    assert first + second + third[:2] == epoch0 and third[2:] == [data.prompts[i] for i in data.order(1)[:2]]
    assert data.order(0) != data.order(1) and data.order(0) == _data(tokenizer, f, seed=3).order(0)
    again, _ = data.batch(4, {"epoch": 0, "row": 4})  # a resumed run continues where the cursor says
    assert again == second
    assert _data(tokenizer, f, shuffle=False).order(5) == list(range(10))


# -- rewards --------------------------------------------------------------------------------
def test_the_built_in_rewards():
    assert exact_match(["q"] * 3, [" 42", "42 ", "41"], answer=["42"] * 3) == [1.0, 1.0, 0.0]
    assert final_answer("so 6 + 7 = 13\n#### 13") == "13" and final_answer("it is \\boxed{3/4}.") == "3/4"
    gsm8k = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    responses = ["... #### 72", "\\boxed{72}", "#### 72.0", "#### 1,000", "the answer is 72", "#### 71"]
    answers = [gsm8k, "72", "72", "1000", "72", "72"]
    assert math_answer([""] * 6, responses, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert math_answer([""], ["\\boxed{0.75}"], ground_truth=["3/4"]) == [1.0]
    # matches over the answer's length, less 0.25 per character past it: a response must stop
    assert position_reward(["ab.="] * 4, ["ba", "b", "bax", "xyzab"], answer=["ba"] * 4) == {
        "reward": [1.0, 0.5, 0.75, -0.75],
        "exact": [1.0, 0.0, 0.0, 0.0],
    }


def test_a_reward_function_by_module_or_file_path(tmp_path):
    fn = load_reward_function("chatlearn_mem_ray.inputs.text_task:position_reward", ["answer"])
    assert fn is position_reward
    f = tmp_path / "my_reward.py"
    f.write_text("def length(prompts, responses, **fields):\n    return [float(len(r)) for r in responses]\n")
    mine = load_reward_function(f"{f}:length")
    assert score(mine, "length", ["p", "q"], ["ab", ""], {}) == ([2.0, 0.0], {})


@pytest.mark.parametrize(
    "spec, said",
    [
        ("no_such_module:f", "cannot be imported: ModuleNotFoundError"),
        ("chatlearn_mem_ray.inputs.text_task:nope", "has no function 'nope'"),
        ("missing.py:f", "missing.py does not exist"),
        ("just_a_name", "give 'package.module:function'"),
        ("chatlearn_mem_ray.inputs.text_task:write_tokenizer", "must accept (prompts, responses, **fields)"),
    ],
)
def test_a_reward_function_that_cannot_be_used_is_named(spec, said):
    with pytest.raises(RewardConfigError) as e:
        load_reward_function(spec, ["answer"])
    assert said in str(e.value) and isinstance(e.value, ConfigError)


def test_a_reward_that_raises_miscounts_or_is_not_finite_names_the_sample():
    def picky(prompts, responses, **fields):
        return [1.0 / (len(r) - 2) for r in responses]  # divides by zero on a 2-character response

    with pytest.raises(RewardError, match=r"raised on sample 1 \(prompt 'q', response 'ab'\): ZeroDivisionError"):
        score(picky, "picky", ["p", "q"], ["abc", "ab"], {})
    with pytest.raises(RewardError, match="returned 1 score\\(s\\) for 2 responses"):
        score(lambda p, r: [1.0], "short", ["p", "q"], ["a", "b"], {})
    with pytest.raises(RewardError, match="returned nan for sample 1"):
        score(lambda p, r: [0.0, math.nan], "nan", ["p", "q"], ["a", "b"], {})
    with pytest.raises(RewardError, match="a dict without 'reward'"):
        score(lambda p, r: {"score": [1.0, 1.0]}, "dict", ["p", "q"], ["a", "b"], {})
    scores, extra = score(lambda p, r: {"reward": [1.0, 0.0], "exact": [1, 1]}, "dict", ["p", "q"], ["a", "b"], {})
    assert scores == [1.0, 0.0] and extra == {"exact": 1.0}


# -- responses --------------------------------------------------------------------------------
def test_responses_end_at_eos_or_a_stop_string_and_the_mask_follows(tokenizer):
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [enc("ab=") + enc("ba") + [eos] + [pad], enc("abcd=") + enc("x+yz")]
    tokens = torch.tensor([r + [pad] * (9 - len(r)) for r in rows])
    prompt_lengths, lengths = torch.tensor([3, 5]), torch.tensor([3, 4])
    texts, cut = decode_responses(tokenizer, tokens, prompt_lengths, lengths, stop=["+"])
    assert texts == ["ba", "x"]  # the EOS and the stop string left out of the text
    assert cut.tolist() == [3, 2]  # their tokens kept in the response: the policy learns to emit them
    mask = response_mask(prompt_lengths, cut, tokens.shape[1] - 1)
    assert mask.tolist() == [
        [0, 0, 1, 1, 1, 0, 0, 0],  # predicting b, a, EOS
        [0, 0, 0, 0, 1, 1, 0, 0],  # predicting x, +
    ]
