"""`POST /v1/responses` through the official client's `responses.create`, plain and streamed, and
through openai-agents with its default Responses model: text and token-id input, instructions,
function tools and their results, `text.format`, usage, and the fields refused with why."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from tests.server.test_openai_api import _client, _raw
from tests.server.test_openai_tool_calls import COLOR_SCHEMA, MODE_SCHEMA, RESULT, prompts, valid  # noqa: F401

MODE_TOOL = {"type": "function", "name": "set_mode", "description": "Set the mode", "parameters": MODE_SCHEMA}
COLOR_TOOL = {"type": "function", "name": "pick_color", "parameters": COLOR_SCHEMA}


async def test_text_input_and_instructions_answer_as_the_same_chat_does(api):
    client = _client(api)
    chat = await client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=8, temperature=0,
    )  # fmt: skip
    done = await client.responses.create(
        model="tiny", instructions="Be brief.", input="hi", max_output_tokens=8, temperature=0
    )
    assert done.object == "response" and done.id.startswith("resp_")
    assert done.output_text == chat.choices[0].message.content
    assert done.output[0].type == "message" and done.output[0].content[0].type == "output_text"
    assert done.usage.input_tokens == chat.usage.prompt_tokens and done.usage.output_tokens == 8
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"  # cut at 8
    items = await client.responses.create(
        model="tiny", instructions="Be brief.", max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    )  # fmt: skip
    assert items.output_text == done.output_text


async def test_token_ids_are_a_raw_prompt_as_completions_take_them(api):
    client = _client(api)
    ids = [5, 6, 7, 8, 9]
    completion = await client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    done = await client.responses.create(model="tiny", input=ids, max_output_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert done.output_text == completion.choices[0].text and done.usage.input_tokens == len(ids)


async def test_a_stream_is_openais_events_adding_up_to_the_whole(api):
    client = _client(api)
    kwargs: dict[str, Any] = {"model": "tiny", "input": "hello there", "max_output_tokens": 10, "temperature": 0}
    whole = await client.responses.create(**kwargs)
    stream = await client.responses.create(**kwargs, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10


async def test_function_tools_are_called_and_their_results_reach_the_next_turn(api, prompts):  # noqa: F811
    client = _client(api)
    done = await client.responses.create(
        model="tiny", input="go fast", tools=[MODE_TOOL, COLOR_TOOL], tool_choice="required", max_output_tokens=128,
        temperature=0,
    )  # fmt: skip
    calls = [item for item in done.output if item.type == "function_call"]
    assert calls and all(valid(c.name, c.arguments) for c in calls) and done.status == "completed"
    named = await client.responses.create(
        model="tiny", input="go", tools=[MODE_TOOL, COLOR_TOOL], tool_choice={"type": "function", "name": "pick_color"},
        max_output_tokens=128, temperature=0,
    )  # fmt: skip
    assert [c.name for c in named.output if c.type == "function_call"] == ["pick_color"]
    history = [
        {"role": "user", "content": "go fast"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": RESULT},
    ]
    await client.responses.create(model="tiny", input=history, tools=[MODE_TOOL], max_output_tokens=4, temperature=0)
    assert RESULT in prompts[-1] and calls[0].name in prompts[-1]
    streamed = await client.responses.create(
        model="tiny", input="go fast", tools=[MODE_TOOL, COLOR_TOOL], tool_choice="required", max_output_tokens=128,
        temperature=0, stream=True,
    )  # fmt: skip
    events = [e async for e in streamed]
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in args] == [c.arguments for c in calls]


async def test_text_format_holds_the_output_to_a_strict_schema(api):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    done = await _client(api).responses.create(
        model="tiny", input="yes or no?", max_output_tokens=64, temperature=0,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert json.loads(done.output_text)["answer"] in ("yes", "no") and done.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("previous_response_id", "resp_1", "not stored here"),
        ("background", True, "no background"),
        ("truncation", "auto", "disabled"),
        ("tools", [{"type": "web_search"}], "only function tools"),
        ("include", ["reasoning.encrypted_content"], "nothing extra"),
        ("service_tier", "flex", "one processing tier"),
        ("temprature", 0.5, ""),
    ],
)
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(api, field, value, says):
    status, reply = await _raw(api, "POST", "/v1/responses", {"model": "tiny", "input": "hi", field: value})
    assert status == 400 and re.split(r"[.\[]", reply["error"]["param"])[0] == field
    assert says in reply["error"]["message"]
    assert not api.core.has_work()


class Verdict(BaseModel):
    answer: Literal["yes", "no"]  # short: the random tiny model ends it well within max_tokens


async def test_openai_agents_runs_on_its_default_responses_model(api):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # nothing is sent anywhere but our server
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{api.server.http_port}/v1", api_key="x", max_retries=0)
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
    settings = agents.ModelSettings(temperature=0, max_tokens=64)
    # An output type (a strict json_schema text.format) ends where the schema does; the tiny random
    # model's free text would run to max_tokens, which agents takes as a failed response.
    typed = agents.Agent(name="typed", model=model, model_settings=settings, output_type=Verdict)
    assert isinstance((await agents.Runner.run(typed, "yes?")).final_output, Verdict)

    calls: list[str] = []

    @agents.function_tool
    def set_mode(mode: Literal["fast", "slow"]) -> str:
        """Set the mode."""
        calls.append(mode)
        return RESULT

    tooled = agents.Agent(
        name="tooled", model=model, tools=[set_mode], output_type=Verdict, tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(temperature=0, max_tokens=128, tool_choice="required"),
    )  # fmt: skip
    result = await agents.Runner.run(tooled, "go fast")
    assert calls and result.final_output == RESULT  # the tool ran; its result ends the run
