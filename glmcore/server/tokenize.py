"""vLLM's tokenizer endpoints: POST /tokenize (a prompt as /v1/completions encodes it, or messages as
/v1/chat/completions renders them), POST /detokenize, GET /tokenizer_info (what lm-eval's remote tokenizer
reads). A prompt tokenized here and sent as ids is the prompt the text would have been."""
from __future__ import annotations

from ..errors import GlmcoreError
from .inputs import check_model, continuing, prompt_ids, to_messages, tool_setup
from .protocol import ApiError, DetokenizeRequest, TokenizeRequest, parse


def tokenize(state, body: bytes) -> dict:
    req = parse(TokenizeRequest, body)
    if req.model is not None:
        check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "send either 'prompt' (text) or 'messages' (a chat), not both or neither", "prompt",
                       "invalid_value")
    if req.prompt is not None:
        if not req.prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
        ids = prompt_ids(state, req.prompt, add_prefix=req.add_special_tokens)
    else:
        try:
            fmt = state.model.chat_format.configured(req.chat_template_kwargs)
        except GlmcoreError as e:
            raise ApiError(400, str(e), "chat_template_kwargs", "invalid_value") from None
        fmt = continuing(fmt, req)
        messages = to_messages(state, req)
        tools, _, _ = tool_setup(fmt, req)
        try:
            ids = fmt.encode_messages(messages, tools=tools,
                                      add_generation_prompt=req.add_generation_prompt and not fmt.continue_final)
        except GlmcoreError as e:
            raise ApiError(400, str(e), "messages") from None
    out = {"count": len(ids), "max_model_len": state.scheduler.capacity, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [state.token_text(i).decode("utf-8", "replace") for i in ids]
    return out


def detokenize(state, body: bytes) -> dict:
    req = parse(DetokenizeRequest, body)
    if req.model is not None:
        check_model(state, req.model)
    tok = state.model.tokenizer
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < tok.n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"'tokens.{bad}' is the token id {req.tokens[bad]}, outside this model's vocabulary "
                       f"(0..{tok.n_vocab - 1})", f"tokens.{bad}", "invalid_value")
    return {"prompt": tok.decode(req.tokens, skip_special=False)}


def tokenizer_info(state) -> dict:
    tok = state.model.tokenizer
    return {"tokenizer_class": type(tok).__name__, "eos_token": tok.special_names.get(tok.eos_id),
            "bos_token": None, "pad_token": None, "model_max_length": state.scheduler.capacity}
