"""The official `openai` Python client, unmodified, against a real `bulkhead serve`.

Run by scripts/test.sh (which makes the virtual environment and sets BULKHEAD_BIN). By hand:
    BULKHEAD_BIN=target/debug/bulkhead "$(tests/python/venv.sh)/bin/pytest" tests/python
"""

import sys

import openai
import pytest

from bulkhead_server import ALIAS, MODEL, serve


@pytest.fixture(scope="session")
def server(request):
    """An openai client of a fresh `bulkhead serve`; the server's log is printed at the end
    when a test failed."""
    with serve() as srv:
        yield openai.OpenAI(base_url=f"http://{srv.addr}/v1", api_key="unused", max_retries=0, timeout=120)
        if request.session.testsfailed:
            print(f"\n--- bulkhead serve log (last lines) ---\n{srv.log_tail()}", file=sys.stderr)


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_list_names_the_served_model(server):
    models = server.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    m = models.data[0]
    assert m.object == "model" and m.owned_by
    assert m.model_extra["max_model_len"] > 0
    assert server.models.retrieve(MODEL).id == MODEL
    assert server.models.retrieve(ALIAS).id == ALIAS
    r = server.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_chat_completion(server):
    r = chat(server, "What is the capital of France?")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_text_completion(server):
    r = server.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.text and c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage_equals_the_plain_answer(server):
    want = chat(server, "Name three colors.")
    chunks = list(chat(server, "Name three colors.", stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    *content, last = chunks
    # The usage chunk comes last, with no choices; every other chunk has usage null.
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in content)
    assert content[0].choices[0].delta.role == "assistant"
    assert content[-1].choices[0].finish_reason == want.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == want.choices[0].message.content
    # The same counts, except the prompt tokens served from the prefix cache: the second
    # time, the same prompt finds at least as much of itself cached.
    got, plain = last.usage.model_dump(), want.usage.model_dump()
    assert got["prompt_tokens_details"]["cached_tokens"] >= plain["prompt_tokens_details"]["cached_tokens"]
    for u in (got, plain):
        u.pop("prompt_tokens_details")
    assert got == plain


def test_chat_stream_without_include_usage_has_no_usage(server):
    chunks = list(chat(server, "Hi", stream=True, max_tokens=4))
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_text_stream_with_usage(server):
    want = server.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    chunks = list(
        server.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == want.usage.completion_tokens
    assert "".join(c.choices[0].text for c in content) == want.choices[0].text


def test_stop_ends_before_the_stop_string(server):
    full = chat(server, "Count from one to ten in words.", max_tokens=24).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    r = chat(server, "Count from one to ten in words.", max_tokens=24, stop=[stop, "never-appears"])
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.message.content == full[: full.index(stop)], (full, stop)


def test_max_tokens_caps_the_completion(server):
    r = chat(server, "Write a long story about a dragon.", max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    r = chat(server, "Write a long story about a dragon.", max_completion_tokens=3)
    assert r.usage.completion_tokens == 3


def test_same_seed_same_output_when_sampling(server):
    def sample(seed):
        return chat(server, "Tell me a joke.", temperature=1.5, seed=seed, max_tokens=8).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    # Sampling is really on: another seed gives another answer.
    assert any(sample(s) != first for s in (1, 2, 3))


def test_over_context_prompt_is_bad_request_context_length_exceeded(server):
    limit = server.models.retrieve(MODEL).model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hello " * (limit + 10))
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hello", max_tokens=limit + 1)
    assert e.value.code == "context_length_exceeded"
    # Streaming requests are refused before the stream starts, with the same error.
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hello " * (limit + 10), stream=True)
    assert e.value.code == "context_length_exceeded"


def test_unknown_model_is_not_found(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        server.models.retrieve("no-such-model")


def test_invalid_parameter_names_its_param(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hi", temperature=3)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"


# Issue 15: what OpenAI-client code sends after `messages`.

import json

from pydantic import BaseModel, Field


class City(BaseModel):
    # Bounds keep a 135M model's answer short; the grammar holds them.
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


def test_parse_returns_a_parsed_object_under_a_pydantic_schema(server):
    # `client.beta.chat.completions.parse` where the client still has it, else its successor.
    completions = getattr(getattr(server, "beta", None), "chat", server.chat).completions
    r = completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give the largest city of France as JSON."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert isinstance(c.message.parsed, City), c.message.content
    assert c.message.parsed.population >= 0


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def test_a_required_tool_call_round_trips_with_its_result(server):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call: with parallel calls allowed this small model goes on calling until max_tokens.
    r = server.chat.completions.create(
        model=MODEL, messages=messages, tools=WEATHER, tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (call,) = c.message.tool_calls[:1]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str)
    # The call and its result go back into the conversation; the next turn answers.
    messages.append(c.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})})
    r = server.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER, tool_choice="none", max_tokens=24, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    # A named function is enforced the same way.
    r = server.chat.completions.create(
        model=MODEL, messages=messages[:1], tools=WEATHER, max_tokens=64, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_streamed_tool_calls_arrive_as_deltas(server):
    chunks = list(
        server.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=WEATHER,
            tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True,
        )
    )
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert deltas, chunks
    assert deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    assert isinstance(json.loads(args)["city"], str)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logprobs_are_consistent_in_both_endpoints_and_streamed(server):
    r = chat(server, "Name a fruit.", max_tokens=6, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # Greedy: the picked token is the most likely one.
        assert e.top_logprobs[0].logprob == e.logprob and bytes(e.bytes) == bytes(e.top_logprobs[0].bytes)
        assert sum(2.718281828 ** t.logprob for t in e.top_logprobs) <= 1.0001
    streamed = list(chat(server, "Name a fruit.", max_tokens=6, logprobs=True, top_logprobs=3, stream=True))
    got = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in got] == [(e.token, round(e.logprob, 5)) for e in entries]
    t = server.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == t.choices[0].text


def test_n_gives_that_many_choices(server):
    r = chat(server, "Tell me a story.", n=3, temperature=1.0, seed=4, max_tokens=12)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    streamed = list(chat(server, "Tell me a story.", n=2, temperature=1.0, seed=4, max_tokens=8, stream=True))
    assert {ch.choices[0].index for ch in streamed if ch.choices} == {0, 1}


def test_unsupported_fields_are_refused_by_name(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hi", extra_body={"prediction": {"type": "content", "content": "x"}})
    assert e.value.param == "prediction"
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, "hi", modalities=["text", "audio"])
    assert e.value.param == "modalities"


def test_a_client_with_its_defaults_fits_a_small_tokens_per_minute(tmp_path):
    """The client's default of no max_tokens against a tenant limited to 1,500 tokens a
    minute (greedy, so the answer ends soon): admitted (charged its prompt and an estimate, not the rest of the
    context), and a prompt larger than the whole budget is refused for good (400 naming the
    limit), not told to retry for ever."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "small"\napi_keys = ["sk-small"]\ntokens_per_minute = 1500\n')
    with serve("--tenants", str(tenants)) as srv:
        client = openai.OpenAI(base_url=f"http://{srv.addr}/v1", api_key="sk-small", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply with one word: hello."}], temperature=0)
        assert r.choices[0].message.content is not None and r.usage.completion_tokens > 0
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1600}])
        assert e.value.code == "request_over_tokens_per_minute" and "1500" in e.value.message
