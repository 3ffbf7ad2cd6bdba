"""The OpenAI-compatible API's request bodies and their validation, and its errors.

Bodies are parsed strictly: wrong types are rejected rather than coerced ("10" is not an
integer), unknown fields are rejected (a misspelt `max_token` would otherwise be silently
ignored), and OpenAI fields this server does not implement are accepted only at their
neutral value (n=1, suffix=null, frequency_penalty=0, ...). The response bodies are in
`replies.py`.
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from charioteer.request import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_SAMPLES = 64  # n and best_of at most (each sample is a request of its own in the queue)
MIN_TEMPERATURE = 1e-5  # below this, sampling is numerically greedy: treat it as greedy


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# ---- models -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = True  # vLLM's default once stream_options is given
    continuous_usage_stats: bool = False  # usage so far in every chunk (vLLM)


class JSONSchemaFormat(_Strict):  # OpenAI's response_format.json_schema
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # `schema` is a pydantic method
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):  # vLLM's structured_outputs (StructuredOutputsParams)
    json_: dict[str, Any] | str | None = Field(None, alias="json")  # `json` is a pydantic method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # vLLM options that choose among its backends; only xgrammar runs here, so they change nothing.
    disable_fallback: bool = False
    disable_additional_properties: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None  # taken at its neutral 0 only
    repetition_penalty: float | None = None  # taken at its neutral 1 only (vllm bench serve sends 1.0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None  # lower first; needs --scheduling-policy priority
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeCompletionRequest(_Strict):  # vLLM's POST /tokenize with a prompt
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Strict):  # vLLM's POST /tokenize with messages
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class DetokenizeRequest(_Strict):  # vLLM's POST /detokenize
    model: str | None = None
    tokens: list[int]


# ---- parsing ------------------------------------------------------------------------------


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def parse_body(raw: bytes, model_cls: type[_Strict]) -> _Strict:
    """Decode, parse and validate a JSON body; raises APIError (400) with the offending param."""
    return validate_body(parse_json(raw), model_cls)


def parse_json(raw: bytes) -> dict:
    """The JSON object of a body; raises APIError (400) if it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8") from None
    if not text.strip():
        raise bad_request("request body is empty: send a JSON object", code="invalid_json")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    try:  # lone surrogates (e.g. "\ud800") decode from JSON but are not text
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body contains a lone UTF-16 surrogate: strings must be valid Unicode",
                          code="invalid_utf8") from None
    if not isinstance(obj, dict):
        raise bad_request(f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    return obj


# Fields a client may try per request that are settings of the whole server.
SERVER_ONLY_FIELDS = {
    "tbt_slo_ms": ": the time-between-tokens SLO steers the token budget that every request shares, so it is "
                  "a server setting (`charioteer serve --tbt-slo-ms MS`), not a request field",
}


def validate_body(obj: dict, model_cls: type[_Strict]) -> _Strict:
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(part) for part in err["loc"] if _is_field(part))
        if err["type"] == "extra_forbidden":
            hint = SERVER_ONLY_FIELDS.get(loc, "")
            raise bad_request(f"unknown field '{loc}'{hint}", param=loc, code="unknown_field") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field '{loc}'", param=loc, code="missing_field") from None
        raise bad_request(f"invalid value for '{loc}': {err['msg']}", param=loc,
                          code="invalid_type" if "type" in err["type"] else "invalid_value") from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_field(part) -> bool:
    """Whether a pydantic error-location part names a field or index, not a union member's type."""
    if isinstance(part, int):
        return True
    return "[" not in part and part not in _TYPE_TAGS and not part[:1].isupper()


def _unsupported(condition: bool, param: str, what: str) -> None:
    if condition:
        raise bad_request(f"{param}: {what} is not supported by this server", param=param, code="unsupported")


def _check_common(req: _Common) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_SAMPLES:
        raise bad_request(f"n must be an integer from 1 to {MAX_SAMPLES}, got {req.n}", param="n")
    _unsupported(req.frequency_penalty not in (None, 0), "frequency_penalty", "a non-zero penalty")
    _unsupported(req.presence_penalty not in (None, 0), "presence_penalty", "a non-zero penalty")
    _unsupported(bool(req.logit_bias), "logit_bias", "logit_bias")
    _unsupported(req.repetition_penalty not in (None, 1), "repetition_penalty", "a repetition penalty other than 1")
    _unsupported(req.min_p not in (None, 0), "min_p", "min_p other than 0")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
    if req.stream_options is not None and req.stream_options.continuous_usage_stats \
            and not req.stream_options.include_usage:
        raise bad_request("stream_options.continuous_usage_stats needs include_usage=true",
                          param="stream_options.continuous_usage_stats")


def sampling_params(req: _Common, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Build SamplingParams, mapping engine ValueErrors to 400s naming the param.

    max_tokens None means "up to the context": the engine thread fills it in once the prompt
    length is known (SamplingParams needs a number, so 1 stands in until then).
    """
    for name, value in (("temperature", req.temperature), ("top_p", req.top_p)):
        if value is not None and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", param=name)
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise bad_request(f"seed must be in [0, {MAX_SEED}], got {req.seed}", param="seed")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="logprobs")
    if req.top_k is not None and req.top_k > 1000:
        raise bad_request(f"top_k must be at most 1000, got {req.top_k}", param="top_k")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be an integer >= 1, got {max_tokens}", param="max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if temperature < 0:
        raise bad_request(f"temperature must be >= 0 (0 means greedy), got {temperature}", param="temperature")
    if temperature < MIN_TEMPERATURE:
        temperature = 0.0
    stop = req.stop
    if isinstance(stop, list) and len(stop) > 16:
        raise bad_request(f"stop takes at most 16 strings, got {len(stop)}", param="stop")
    if stop is not None and any(not s for s in ([stop] if isinstance(stop, str) else stop)):
        raise bad_request("stop strings must be non-empty", param="stop")
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            max_tokens=1 if max_tokens is None else max_tokens,
            stop=stop,
            stop_token_ids=req.stop_token_ids or [],
            seed=req.seed,
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            priority=req.priority or 0,
            n=req.n or 1,
            best_of=getattr(req, "best_of", None),
        )
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0] if message.split(" ", 1)[0] in SamplingParams.__dataclass_fields__ else None
        raise bad_request(message, param=param) from None


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion: a string, a token-id list, or a list of either."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("prompt is empty: give a non-empty string or a list of token ids", param="prompt")
    for i, one in enumerate(prompts):
        if not one:
            where = "prompt" if len(prompts) == 1 else f"prompt {i}"
            raise bad_request(f"{where} is empty: give a non-empty string or a list of token ids", param="prompt")
    return prompts


def check_completion(req: CompletionRequest) -> None:
    _check_common(req)
    _unsupported(req.suffix is not None, "suffix", "suffix")
    if req.best_of is not None and not (req.n or 1) <= req.best_of <= MAX_SAMPLES:
        raise bad_request(f"best_of must be an integer from n ({req.n or 1}) to {MAX_SAMPLES}, got {req.best_of}",
                          param="best_of")
    if req.stream and (req.best_of or 1) > (req.n or 1):
        raise bad_request("best_of larger than n needs every sample finished before it can choose: use "
                          "stream=false, or set best_of equal to n", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be an integer >= 1 (0 only with echo=true, which returns the prompt)",
                          param="max_tokens")


def check_chat(req: ChatCompletionRequest) -> None:
    _check_common(req)
    _unsupported(bool(req.tools) or req.tool_choice not in (None, "none"), "tools", "tool calling")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; give one", param="max_tokens")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and plain text content."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        if content is None:
            raise bad_request(f"messages.{i}.content is missing", param=f"messages.{i}.content")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    if all(not m["content"] for m in out):
        raise bad_request("messages are all empty: give some text", param="messages")
    return out


def check_tokenize_chat(req: TokenizeChatRequest) -> None:
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                          param="continue_final_message")
    _unsupported(req.continue_final_message, "continue_final_message", "continue_final_message=true")
    _unsupported(req.chat_template is not None, "chat_template", "a chat template other than the model's")
    _unsupported(bool(req.chat_template_kwargs), "chat_template_kwargs", "chat_template_kwargs")
    _unsupported(bool(req.tools), "tools", "tools")


# ---- structured outputs -------------------------------------------------------------------


def structured_outputs(req: _Common) -> tuple[StructuredOutputsParams, str] | None:
    """The output constraint a request asks for, and the field it came from; None if it asks none.

    One of response_format (json_object, json_schema), structured_outputs, or a guided_* field.
    Whether it compiles is checked later, off the event loop (AsyncEngine.compile_grammar).
    """
    asked = [(param, build) for param, build in _constraint_sources(req) if build is not None]
    if len(asked) > 1:
        names = ", ".join(param for param, _ in asked)
        raise bad_request(f"give one output constraint, not several: {names}", param=asked[1][0],
                          code="conflicting_constraints")
    _unsupported(req.guided_whitespace_pattern is not None, "guided_whitespace_pattern", "a whitespace pattern")
    _unsupported(req.guided_decoding_backend not in (None, "auto", "xgrammar"), "guided_decoding_backend",
                 f"the backend {req.guided_decoding_backend!r} (only xgrammar runs here)")
    if not asked:
        return None
    param, build = asked[0]
    try:
        spec = build()
    except ValueError as exc:  # StructuredOutputsParams names its own fields: name the request's
        message = str(exc)
        if param.startswith("guided_"):
            message = message.replace(f"structured_outputs.{param[len('guided_'):]}", param)
        elif param == "response_format":
            message = message.replace("structured_outputs.json", "response_format.json_schema.schema")
        raise bad_request(message, param=param) from None
    if param == "structured_outputs":
        param = f"structured_outputs.{spec.kind}"
    elif param == "response_format" and spec.kind == "json":
        param = "response_format.json_schema.schema"
    return spec, param


def _constraint_sources(req: _Common):
    """(field name, a builder of its StructuredOutputsParams, or None when the field asks nothing)."""
    fmt = req.response_format
    yield "response_format", None if fmt is None or fmt.type == "text" else lambda: _from_response_format(fmt)
    so = req.structured_outputs
    yield "structured_outputs", None if so is None else lambda: _from_structured_outputs(so)
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        yield f"guided_{name}", None if value is None else (lambda n=name, v=value: StructuredOutputsParams(**{n: v}))


def _from_response_format(fmt: ResponseFormat) -> StructuredOutputsParams:
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise bad_request("response_format of type json_schema needs json_schema.schema",
                          param="response_format.json_schema.schema", code="missing_field")
    return StructuredOutputsParams(json=fmt.json_schema.schema_)


def _from_structured_outputs(so: StructuredOutputs) -> StructuredOutputsParams:
    _unsupported(so.structural_tag is not None, "structured_outputs.structural_tag", "structural_tag")
    _unsupported(so.whitespace_pattern is not None, "structured_outputs.whitespace_pattern", "a whitespace pattern")
    return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                   json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)
