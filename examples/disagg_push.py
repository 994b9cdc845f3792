"""The proxy's `--push` flow (examples/disagg_proxy.py): D is sent the request first, P its
prefill at the same time, and P pushes each layer's blocks into D's cache as it computes them.

Per request: a transfer id T (uuid hex); D gets the original request with `kv_transfer_params:
{"do_remote_prefill": true, "push": true, "remote_host", "remote_port" (P's side channel, from
P's GET /v1/kv_transfer, asked once per P), "remote_request_id": T, "remote_block_ids": []}`, and
P, concurrently, the prefill body with `{"do_remote_decode": true, "push": true, "transfer_id":
T}`. D registers with P, receives the prompt's blocks (all but the last token's, which D
computes: P's first token is not known to D) and answers. When P's prefill fails, its answer is
the client's and D's request is closed (D aborts it; had it been waiting for the push, it would
have computed the prompt itself after its connector's `timeout_s`).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any, Awaitable, Callable

if TYPE_CHECKING:
    import httpx

# POST `body` to `url`'s `path`, read whole unless `stream` (the proxy's `send`).
Send = Callable[..., Awaitable["httpx.Response"]]


class SideChannels:
    """Each prefill server's side channel (host, port), asked once from its GET
    /v1/kv_transfer."""

    def __init__(self, client: "httpx.AsyncClient"):
        self.client = client
        self.known: dict[str, tuple[str, int]] = {}

    async def of(self, url: str) -> tuple[str, int]:
        """`url`'s side channel; a LookupError saying why when it has none."""
        if url not in self.known:
            reply = await self.client.get(f"{url}/v1/kv_transfer")
            found = reply.json() if reply.status_code == 200 else {}
            if not (isinstance(found, dict) and isinstance(found.get("host"), str)
                    and isinstance(found.get("port"), int) and found["port"] > 0):
                raise LookupError(f"the prefill server {url} gives no KV side channel (GET "
                                  f"/v1/kv_transfer answered {reply.status_code}): start it with "
                                  "a kv_producer --kv-transfer-config whose "
                                  "kv_connector_extra_config has push: true")
            self.known[url] = (found["host"], found["port"])
        return self.known[url]


def push_bodies(body: dict[str, Any], prefill: dict[str, Any], side_channel: tuple[str, int]
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """D's and P's bodies for one pushed request (`prefill`: P's body as for a pull)."""
    transfer_id = uuid.uuid4().hex
    host, port = side_channel
    decode = {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "push": True, "remote_host": host, "remote_port": port,
        "remote_request_id": transfer_id, "remote_block_ids": []}}
    prefill = {**prefill, "kv_transfer_params": {
        "do_remote_decode": True, "push": True, "transfer_id": transfer_id}}
    return decode, prefill


class Unreachable(Exception):
    """The `role` server at `url` could not be reached or did not answer in time (`error`)."""

    def __init__(self, role: str, url: str, error: "httpx.HTTPError"):
        super().__init__(f"{role} {url}: {error}")
        self.role, self.url, self.error = role, url, error


async def pushed(send: Send, prefill_url: str, decode_url: str, path: str,
                 bodies: tuple[dict[str, Any], dict[str, Any]], stream: bool
                 ) -> tuple["httpx.Response", "httpx.Response | None"]:
    """P's reply and, when P answered 200, D's (streamed unread when `stream`); otherwise None,
    D's request closed. Unreachable when either server is."""
    import httpx

    decode_body, prefill_body = bodies
    decoding = asyncio.ensure_future(send(decode_url, path, decode_body, stream))
    try:
        prefill = await send(prefill_url, path, prefill_body)
    except httpx.HTTPError as error:
        await _close(decoding)
        raise Unreachable("prefill", prefill_url, error) from error
    except BaseException:  # the client left: D's request too
        await _close(decoding)
        raise
    if prefill.status_code != 200:
        await _close(decoding)
        return prefill, None
    try:
        return prefill, await decoding
    except httpx.HTTPError as error:
        raise Unreachable("decode", decode_url, error) from error


async def _close(decoding: "asyncio.Future[httpx.Response]") -> None:
    """Cancel D's request, or close its answer: either way D sees its client gone, aborts."""
    decoding.cancel()
    try:
        reply = await decoding
    except BaseException:  # noqa: BLE001 - cancelled, or failed: nothing left to close
        return
    await reply.aclose()
