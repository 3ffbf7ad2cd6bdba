"""Structured outputs (xgrammar): JSON schemas, json_object, regex, choice and EBNF grammars, through
the official `openai` client against a real server on SmolLM2, and through the offline LLM.

Every string and array in the schemas is bounded (maxLength, maxItems), so the grammar itself
forces the output to end within max_tokens: a finished output that does not validate is a bug.
"""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer

from charioteer import LLM, SamplingParams, StructuredOutputsParams
from charioteer.engine.structured_output import tokenizer_info
from charioteer.serving.api import ServerConfig

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SHORT = {"type": "string", "maxLength": 24}

# (what to ask for, schema)
SCHEMAS = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer"}},
                  "required": ["name", "age"]}),
    ("a person's age", {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65}},
                        "required": ["age"]}),
    ("a temperature", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -40, "maximum": 50}}, "required": ["celsius"]}),
    ("a probability", {"type": "object", "properties": {
        "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}, "required": ["p"]}),
    ("a traffic light", {"type": "object", "properties": {
        "color": {"type": "string", "enum": ["red", "amber", "green"]}}, "required": ["color"]}),
    ("a light switch", {"type": "object", "properties": {"on": {"type": "boolean"}, "room": NAME},
                        "required": ["on", "room"]}),
    ("three fruits", {"type": "object", "properties": {
        "fruits": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}, "required": ["fruits"]}),
    ("an address", {"type": "object", "properties": {
        "name": NAME,
        "address": {"type": "object", "properties": {"street": SHORT, "city": NAME, "zip": {
            "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]}},
        "required": ["name", "address"]}),
    ("a class of students", {"type": "object", "properties": {"students": {
        "type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "name": NAME, "grade": {"type": "integer", "minimum": 1, "maximum": 12}}, "required": ["name", "grade"]}}},
        "required": ["students"]}),
    ("a book, its subtitle optional", {"type": "object", "properties": {
        "title": SHORT, "subtitle": SHORT, "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["title", "pages"]}),
    ("a version tag", {"type": "object", "properties": {"kind": {"const": "version"},
                                                        "major": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["kind", "major"]}),
    ("an identifier", {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                          "maximum": 9999}, NAME]}},
                       "required": ["id"]}),
    ("a nickname, or null if none", {"type": "object", "properties": {
        "nickname": {"type": ["string", "null"], "maxLength": 12}}, "required": ["nickname"]}),
    ("an airport code", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                         "required": ["code"]}),
    ("a dice roll", {"type": "object", "properties": {"roll": {"type": "integer", "enum": [1, 2, 3, 4, 5, 6]}},
                     "required": ["roll"]}),
    ("a company", {"type": "object", "properties": {"company": {"type": "object", "properties": {
        "name": NAME, "ceo": {"type": "object", "properties": {"name": NAME, "born": {
            "type": "integer", "minimum": 1900, "maximum": 2010}}, "required": ["name", "born"]}},
        "required": ["name", "ceo"]}}, "required": ["company"]}),
    ("a lottery ticket", {"type": "object", "properties": {"numbers": {
        "type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 49}, "minItems": 3, "maxItems": 3}},
        "required": ["numbers"]}),
    ("a tagged note", {"type": "object", "properties": {"text": SHORT, "tags": {
        "type": "array", "maxItems": 2, "items": {"enum": ["work", "home", "urgent"]}}},
        "required": ["text", "tags"], "additionalProperties": False}),
    ("two points", {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10}, "y": {"type": "integer", "minimum": -10,
                                                                      "maximum": 10}}, "required": ["x", "y"]}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"]}),
    ("a list of weekdays", {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                            "minItems": 1, "maxItems": 3}),
    ("a password rule", {"type": "object", "properties": {"min_length": {"type": "integer", "minimum": 8,
                                                                         "maximum": 64},
                                                          "symbols": {"type": "boolean"}, "example": {
        "type": "string", "minLength": 8, "maxLength": 16}}, "required": ["min_length", "symbols", "example"]}),
    ("a shape", {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0, "maximum": 100}},
         "required": ["circle"]},
        {"type": "object", "properties": {"square": {"type": "number", "minimum": 0, "maximum": 100}},
         "required": ["square"]}]}}, "required": ["shape"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "number", "minimum": 0, "maximum": 5},
                                                   "comment": SHORT}, "required": ["stars"]}),
]


@pytest.fixture(scope="module")
def server(default_model):
    s = LiveServer(default_model, ServerConfig(), scheduler="sarathi", chunk_size=64, max_num_seqs=8)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Give {what} as JSON."}]


def _schema_call(client, server, i: int, what: str, schema: dict):
    """Four ways to send a schema, in turn: OpenAI's response_format, vLLM's structured_outputs
    (sampled, compact), vLLM's older guided_json, and the completions endpoint."""
    common = {"model": server.model, "max_tokens": 200}
    if i % 4 == 0:
        return client.chat.completions.create(messages=_ask(what), temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}, **common)
    if i % 4 == 1:
        return client.chat.completions.create(messages=_ask(what), temperature=0.7, seed=i, extra_body={
            "structured_outputs": {"json": schema, "disable_any_whitespace": True}}, **common)
    if i % 4 == 2:
        return client.chat.completions.create(messages=_ask(what), temperature=0,
                                              extra_body={"guided_json": json.dumps(schema)}, **common)
    return client.completions.create(prompt=f"Here is {what} as JSON:\n", temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}, **common)


def _text(reply) -> tuple[str, str]:
    choice = reply.choices[0]
    text = choice.message.content if hasattr(choice, "message") else choice.text
    return text, choice.finish_reason


def test_every_schema_output_parses_and_validates(server, client):
    assert len(SCHEMAS) >= 20
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda args: _schema_call(client, server, *args),
                                [(i, what, schema) for i, (what, schema) in enumerate(SCHEMAS)]))
    for (what, schema), reply in zip(SCHEMAS, replies):
        text, finish = _text(reply)
        assert finish == "stop", (what, text)
        jsonschema.validate(json.loads(text), schema)
    assert server.wait_idle()["charioteer:kv_cache_usage_perc"] == 0


def test_streamed_schema_output_validates(server, client):
    what, schema = SCHEMAS[8]
    chunks = list(client.chat.completions.create(
        model=server.model, messages=_ask(what), temperature=0, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "class", "schema": schema}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object(server, client):
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe a cat as a JSON object with its name "
                                       "and color."}],
        temperature=0, max_tokens=100, response_format={"type": "json_object"})
    text, finish = _text(reply)
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_text_format_is_unconstrained(server, client):
    kw = dict(model=server.model, messages=_ask("a poem"), temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**kw)
    text = client.chat.completions.create(response_format={"type": "text"}, **kw)
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_regex(server, client):
    pattern = r"[A-Z][a-z]{1,10} is [1-9][0-9]? years old\."
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        reply = client.chat.completions.create(model=server.model, messages=_ask("a person's name and age"),
                                               temperature=0, max_tokens=40, extra_body=extra)
        text, finish = _text(reply)
        assert finish == "stop" and re.fullmatch(pattern, text), text


def test_choice(server, client):
    choices = ["positive", "negative", "neutral", 'with "quotes" and \\ backslash']
    for i, extra in enumerate([{"guided_choice": choices}] + [{"structured_outputs": {"choice": choices}}] * 3):
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Is 'I love this film' positive?"}],
            temperature=0 if i == 0 else 1.0, seed=i, max_tokens=20, extra_body=extra)
        text, finish = _text(reply)
        assert finish == "stop" and text in choices, text


def test_ebnf_grammar(server, client):
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,30} "."'
    for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        reply = client.completions.create(model=server.model, prompt="Is the sky blue? Answer:", temperature=0,
                                          max_tokens=40, extra_body=extra)
        text, finish = _text(reply)
        assert finish == "stop" and re.fullmatch(r"(yes|no) because [a-z ]{1,30}\.", text), text


def test_a_schema_compiles_once(server, client):
    compiler = server.engine.structured_outputs
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    misses = compiler.misses
    for _ in range(2):
        reply = client.chat.completions.create(model=server.model, messages=_ask("a digit"), temperature=0,
                                               max_tokens=30, extra_body={"guided_json": schema})
        jsonschema.validate(json.loads(_text(reply)[0]), schema)
    assert compiler.misses == misses + 1  # the second request, and the engine thread, hit the cache


# ---- bad constraints: a 400 naming the problem, while others carry on -----------------------------

CH, C = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]
BAD = [
    # (name, path, body fields, param, words the message must hold)
    ("unknown schema type", CH, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "response_format.json_schema.schema", "bogus"),
    ("schema not json", CH, {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("schema ref to nowhere", CH, {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}},
     "structured_outputs.json", "JSON schema"),
    ("unclosed regex", CH, {"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ("unclosed regex, structured_outputs", C, {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex",
     "regex"),
    ("undefined grammar rule", C, {"guided_grammar": "root ::= missing"}, "guided_grammar", "missing"),
    ("empty choice", CH, {"guided_choice": []}, "guided_choice", "non-empty"),
    ("json_schema without schema", CH, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema"),
    ("json_schema without name", CH, {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format.json_schema.name", "name"),
    ("unknown response_format type", CH, {"response_format": {"type": "yaml"}}, "response_format.type", "json"),
    ("two constraints", CH, {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "one"),
    ("two kinds in structured_outputs", CH, {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("nothing in structured_outputs", CH, {"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ("structural tag", CH, {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ("whitespace pattern", CH, {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"},
     "guided_whitespace_pattern", "not supported"),
    ("another backend", CH, {"guided_regex": "a+", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend", "xgrammar"),
]


@pytest.mark.parametrize("name,path,fields,param,words", BAD, ids=[b[0] for b in BAD])
def test_bad_constraint_gets_400(server, name, path, fields, param, words):
    body = {"max_tokens": 5, **({"messages": MSG} if path == CH else {"prompt": "Hi"}), **fields}
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words.lower() in err["message"].lower(), err
    assert "/project/cpp" not in err["message"] and ".cc:" not in err["message"], err


def test_bad_constraints_leave_running_requests_alone(server, client):
    want = client.chat.completions.create(model=server.model, messages=_ask("a poem"), temperature=0, max_tokens=48)
    got: list = []
    running = threading.Thread(target=lambda: got.append(client.chat.completions.create(
        model=server.model, messages=_ask("a poem"), temperature=0, max_tokens=48)))
    running.start()
    for name, path, fields, param, _ in BAD[:7]:
        test_bad_constraint_gets_400(server, name, path, fields, param, "")
    running.join()
    assert got[0].choices[0].message.content == want.choices[0].message.content
    assert server.healthy() and server.wait_idle()["charioteer:kv_cache_usage_perc"] == 0


# ---- the engine -----------------------------------------------------------------------------------


def test_unconstrained_greedy_outputs_ignore_constrained_neighbours(default_model):
    llm = LLM(default_model, max_num_seqs=8, chunk_size=64)
    plain = [llm.apply_chat_template(_ask(what)) for what, _ in SCHEMAS[:4]]
    alone = llm.generate(plain, SamplingParams(temperature=0, max_tokens=32))
    steps = []
    llm.engine.subscribe(steps.append)
    constrained = [SamplingParams(temperature=t, seed=1, max_tokens=64,
                                  structured_outputs=StructuredOutputsParams(json=schema))
                   for t, (_, schema) in zip((0, 0.8, 0, 0.8), SCHEMAS[4:8])]
    mixed = llm.generate(plain + [llm.apply_chat_template(_ask(w)) for w, _ in SCHEMAS[4:8]],
                         [SamplingParams(temperature=0, max_tokens=32)] * 4 + constrained)
    ids = [o.request_id for o in mixed]
    shared = [s for s in steps if {e.request_id for e in s.entries if e.samples} >= {ids[0], ids[4]}]
    assert len(shared) >= 8, "the constrained and unconstrained requests should share decode steps"
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    for out, (_, schema) in zip(mixed[4:], SCHEMAS[4:8]):
        jsonschema.validate(json.loads(out.text), schema)


def test_preempted_constrained_requests_keep_their_grammar(default_model):
    schema = SCHEMAS[8][1]
    prompts = [default_model.tokenizer.encode(f"Student list number {i}, as JSON:\n") for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    roomy = LLM(default_model, max_num_seqs=8, chunk_size=32).generate(prompts, params)
    tight = LLM(default_model, max_num_seqs=8, chunk_size=32, num_kv_blocks=12, block_size=16)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in roomy]
    for out in got:
        jsonschema.validate(json.loads(out.text), schema)


def test_grammar_end_finishes_even_with_ignore_eos(default_model):
    llm = LLM(default_model)
    forced = StructuredOutputsParams(choice=["yes"])
    out = llm.generate("The answer is", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0,
                                                        prompt_logprobs=0, structured_outputs=forced))[0]
    assert out.text == "yes" and out.outputs[0].finish_reason == "stop"
    # Logprobs are the masked distribution's (as vLLM's): after "yes" only the stop token is allowed.
    last = out.outputs[0].logprobs[-1]
    assert out.outputs[0].token_ids[-1] == default_model.config.eos_token_id and last == {
        default_model.config.eos_token_id: 0.0}


def test_tokenizer_info_of_a_byte_level_bpe(default_model):
    import xgrammar as xgr

    tok = default_model.tokenizer
    eos = default_model.config.eos_token_id
    info = tokenizer_info(tok, default_model.config.vocab_size, [eos])
    assert tok.byte_encoding() == "byte_level" and not tok.prepends_space()
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.stop_token_ids == [eos]
    im_start = tok.encode("<|im_start|>", add_special_tokens=False)[0]
    assert im_start in info.special_token_ids and eos not in info.special_token_ids
    space_hello = tok.encode(" hello", add_special_tokens=False)
    assert len(space_hello) == 1 and info.decoded_vocab[space_hello[0]] == b" hello"


def test_bad_offline_constraint_raises_before_anything_runs(default_model):
    llm = LLM(default_model)
    with pytest.raises(ValueError, match="regex does not compile"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4),
                                  SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="("))])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    assert not llm.engine.has_unfinished_requests()
