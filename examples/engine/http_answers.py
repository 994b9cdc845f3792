"""A request's engine outputs turned into its HTTP answer: one JSON body, or server-sent events.

A request with `n` choices runs as `n` engine requests; their output streams are merged here,
each output tagged with its choice's index. Closing the merged stream (a client that went
away) closes every one, which aborts the engine requests and frees their blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .errors import RequestFailed
from .logprobs import TokenLogprobs
from .metrics import ServerMetrics
from .request import RequestOutput
from .responses import Choice, ResponseFormat, error_body

Outputs = AsyncIterator[RequestOutput]
Tagged = AsyncIterator[tuple[int, RequestOutput]]


async def resume(first: RequestOutput, outputs: Outputs, echo_text: str = "") -> Outputs:
    """`outputs` with `first`, already taken from it, back in front (its text after the
    prompt's under `echo`); closing it closes them."""
    if echo_text:
        first = dataclasses.replace(first, text=echo_text + first.text)
    try:
        yield first
        async for output in outputs:
            yield output
    finally:
        await outputs.aclose()


async def merged(streams: list[Outputs]) -> Tagged:
    """Every output of `streams` as `(index, output)`, in the order they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: Outputs) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as error:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def logprobs_of(output: RequestOutput) -> list[TokenLogprobs] | None:
    """An output's logprobs entries: its prompt's (first output, `echo`), then its token's."""
    entries = [*(output.prompt_logprobs or ()), *([output.logprobs] if output.logprobs else [])]
    return entries or None


async def collect(outputs: Tagged, num_choices: int, fmt: ResponseFormat, prompt_tokens: int,
                  metrics: ServerMetrics, http: Request,
                  on_failure: Callable[[RequestFailed], Response]) -> Response:
    """A non-streaming answer: every output of every choice, joined.

    A client that disconnects is noticed at a request's next token: closing `outputs` then
    aborts the requests and frees their blocks, as for a stream.
    """
    choices = [Choice() for _ in range(num_choices)]
    try:
        async for index, output in outputs:
            metrics.observe(output)
            choice = choices[index]
            choice.text += output.text
            choice.logprobs = [*(choice.logprobs or ()), *(logprobs_of(output) or ())] or None
            choice.finish_reason, choice.num_tokens = output.finish_reason, output.num_output_tokens
            choice.num_cached_tokens = output.num_cached_tokens
            choice.kv_transfer_params = output.kv_transfer_params
            if not output.finish_reason and await http.is_disconnected():
                await outputs.aclose()
                return Response(status_code=499)  # nobody reads it; nginx's "client closed"
    except RequestFailed as error:
        return on_failure(error)
    return JSONResponse(fmt.response(choices, prompt_tokens))


async def events(outputs: Tagged, fmt: ResponseFormat, metrics: ServerMetrics,
                 usage_prompt_tokens: int | None) -> AsyncIterator[str]:
    """Server-sent events: one chunk per token of any choice (a choice's last one with its
    `kv_transfer_params`, when the KV connector gave any), then (when `usage_prompt_tokens` is
    given, for `stream_options.include_usage`) a chunk with the token counts (the prompt's
    cached ones too), then `[DONE]`.

    A failure after the first token can only be told in the stream, as an error event. A
    client that disconnects ends this generator; closing `outputs` then aborts the requests in
    the engine, which frees their blocks before the next step.
    """
    generated: dict[int, int] = {}
    cached = 0  # the first choice's, as in a whole answer (ResponseFormat.response)
    try:
        async for index, output in outputs:
            metrics.observe(output)
            chunk = fmt.chunk(index, output.text, output.finish_reason, logprobs_of(output),
                              output.kv_transfer_params)
            yield f"data: {json.dumps(chunk)}\n\n"
            generated[index] = output.num_output_tokens
            if index == 0:
                cached = output.num_cached_tokens
        if usage_prompt_tokens is not None:
            usage = fmt.usage_chunk(usage_prompt_tokens, sum(generated.values()), cached)
            yield f"data: {json.dumps(usage)}\n\n"
    except RequestFailed as error:
        yield f"data: {json.dumps(error_body(str(error), None, 'server_error'))}\n\n"
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"
