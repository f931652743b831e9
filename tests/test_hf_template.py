"""tokenizer.json + tokenizer_config.json checkpoints (GLM-4-0414, GLM-Z1, GLM-Edge): glmcore's tokenizer and
template rendering against transformers' own PreTrainedTokenizerFast / apply_chat_template on the same files.

The real GLM-4-0414/GLM-Edge tokenizer files are not in this workspace: the fixtures are written by
glmcore.synth in their published layout (GLM-4's byte-level BPE and split pattern, the 14 special tokens
after the ranks, the [gMASK]<sop> post-processor, the chat templates as the model cards show them)."""
import json
import shutil

import numpy as np
import pytest

from glmcore.chat import Message, ToolCall, chat_format_for
from glmcore.hf_tokenizer import GLM_Z1_TEMPLATE, tokenizer_json
from glmcore.synth import make_model
from glmcore.tokenizer import GLM4_RANKS_FILE, GLM4_SPECIALS, TiktokenTokenizer, load_tokenizer, read_rank_file

transformers = pytest.importorskip("transformers")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "查询天气",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "你好"}],
    [{"role": "system", "content": "你是一个助手。"}, {"role": "user", "content": "Hi there!\n  two spaces"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "写一首诗"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "late system goes first"}],
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    out = {f: root / f for f in ("glm4-0414", "glm-edge")}
    for f, d in out.items():
        make_model(f, "tiny", d)
    z1 = root / "glm-z1"
    shutil.copytree(out["glm4-0414"], z1)
    cfg = json.loads((z1 / "tokenizer_config.json").read_text())
    cfg["chat_template"] = GLM_Z1_TEMPLATE
    (z1 / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    out["glm-z1"] = z1
    return out


@pytest.mark.parametrize("name", ["glm4-0414", "glm-edge", "glm-z1"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_prompt_ids_equal_apply_chat_template(dirs, name, conv):
    d = dirs[name]
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    fmt = chat_format_for(load_tokenizer(d, "glm-edge" if name == "glm-edge" else "glm4-0414"))
    msgs = CONVERSATIONS[conv]
    want = theirs.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert fmt.encode_messages(msgs) == list(want)
    text = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert fmt.render(msgs) == text


def test_tools_and_calls_render_as_transformers(dirs):
    d = dirs["glm4-0414"]
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    fmt = chat_format_for(load_tokenizer(d, "glm4-0414"))
    msgs = [Message("user", "北京天气？"), Message("assistant", tool_calls=[ToolCall("get_weather", {"city": "北京"})]),
            Message("tool", '{"temp": 20}')]
    as_dicts = [{"role": "user", "content": "北京天气？"},
                {"role": "assistant", "metadata": "get_weather", "content": '{"city": "北京"}'},
                {"role": "observation", "content": '{"temp": 20}'}]
    want = theirs.apply_chat_template(as_dicts, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                      return_dict=False)
    assert fmt.encode_messages(msgs, tools=TOOLS) == list(want)
    # GLM-4-0414 writes the tools without GLM-4's built-in system text
    assert "智谱AI" not in fmt.render(msgs, tools=TOOLS) and "# 可用工具" in fmt.render(msgs, tools=TOOLS)


def test_z1_template_drops_earlier_thinking(dirs):
    fmt = chat_format_for(load_tokenizer(dirs["glm-z1"], "glm4-0414"))
    text = fmt.render([{"role": "user", "content": "1+1?"},
                       {"role": "assistant", "content": "<think>one and one</think>\n\n2"},
                       {"role": "user", "content": "2+2?"}])
    assert "one and one" not in text and "<|assistant|>\n2<|user|>" in text
    assert not fmt.can_continue


def test_special_tokens_prefix_and_stop_ids_from_the_files(dirs):
    t4 = load_tokenizer(dirs["glm4-0414"], "glm4-0414")
    te = load_tokenizer(dirs["glm-edge"], "glm-edge")
    n = 2048
    assert t4.special_ids["[gMASK]"] == n + 2 and t4.eos_id == n and t4.pad_id == n
    assert t4.stop_ids == [n, n + 7, n + 9]          # generation_config.json: <|endoftext|>, <|user|>, <|observation|>
    f4, fe = chat_format_for(t4), chat_format_for(te)
    assert f4.prefix == [n + 2, n + 4] and fe.prefix == []
    assert fe.render([{"role": "user", "content": "x"}]).endswith("<|assistant|>\n")
    # plain text that spells a special token stays text
    assert all(i < n for i in t4.encode("<|user|>[gMASK]"))
    theirs = transformers.AutoTokenizer.from_pretrained(dirs["glm4-0414"])
    assert theirs("hi")["input_ids"][:2] == [n + 2, n + 4]       # the post-processor's [gMASK]<sop>


def test_converted_tiktoken_file_encodes_like_the_tiktoken_path(tmp_path):
    """tokenizer.json from GLM-4's rank file (ours and transformers' TikTokenConverter) give the ids of the
    tiktoken path on every string."""
    import tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ranks = read_rank_file(GLM4_RANKS_FILE)
    (tmp_path / "tokenizer.model").write_bytes(GLM4_RANKS_FILE.read_bytes())
    native = TiktokenTokenizer(tmp_path / "tokenizer.model")
    ours = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json(ranks, GLM4_SPECIALS)))
    theirs = TikTokenConverter(str(tmp_path / "tokenizer.model")).converted()
    rng = np.random.default_rng(0)
    pieces = ["你好", " world", "\n\n", "  ", "123456", "I'm", "Ωλ", "🙂", "\t", "def f():", "ÿ", "x" * 40]
    texts = ["".join(rng.choice(pieces, 8)) for _ in range(200)] + pieces
    for t in texts:
        want = native.encode(t)
        assert ours.encode(t, add_special_tokens=False).ids == want, t
        assert theirs.encode(t, add_special_tokens=False).ids == want, t


RAW_PROMPTS = ["plain text", "[gMASK]<sop><|user|>\nhi<|assistant|>\nok", "a <|user|>b<|assistant|>", "<|endoftext|>",
               "<|user|><|user|>\n", "<|us er|> [gMASK]x<sop"]


@pytest.mark.parametrize("name", ["glm4-0414", "glm-edge"])
def test_raw_prompt_reads_special_tokens_as_transformers(dirs, name):
    """A raw prompt (what /v1/completions gets) is tokenizer(prompt) less its post-processor's prefix: spelled-out
    special tokens are the tokens, as transformers, vLLM and llama-server read a prompt a client rendered itself."""
    theirs = transformers.AutoTokenizer.from_pretrained(dirs[name])
    tok = load_tokenizer(dirs[name], "glm-edge" if name == "glm-edge" else "glm4-0414")
    for text in RAW_PROMPTS:
        assert tok.encode_prompt(text) == theirs(text, add_special_tokens=False)["input_ids"], text
    assert tok.encode("<|user|>") != [tok.special_ids["<|user|>"]]      # chat text stays text


def test_raw_prompt_special_tokens_in_the_native_tokenizers(tmp_path):
    """GLM-4's tiktoken tokenizer matches its registered special tokens in a raw prompt (ChatGLM4Tokenizer's added
    tokens split the text first); ChatGLM2/3's SentencePiece tokenizer keeps them text (THUDM's ChatGLMTokenizer,
    encode_special_tokens=False)."""
    import tiktoken
    make_model("glm4", "tiny", tmp_path / "g4")
    glm4 = load_tokenizer(tmp_path / "g4", "glm4")
    ref = tiktoken.Encoding(name="ref", pat_str=glm4.enc._pat_str, mergeable_ranks=glm4.enc._mergeable_ranks,
                            special_tokens=glm4.special_ids)
    for text in RAW_PROMPTS:
        assert glm4.encode_prompt(text) == ref.encode(text, allowed_special="all"), text
    make_model("chatglm3", "tiny", tmp_path / "g3")
    glm3 = load_tokenizer(tmp_path / "g3", "chatglm3")
    assert glm3.encode_prompt(RAW_PROMPTS[1]) == glm3.encode(RAW_PROMPTS[1])
