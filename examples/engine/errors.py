"""The errors a request can end with: refused (which field is wrong, and why), or failed; and
the one that ends the engine itself."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot serve as asked; `param` names the offending field.

    The server answers it with HTTP `status` (400) and the message; it never reaches the model.
    """

    status = 400

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class BodyTooLarge(RequestError):
    """A request body over the server's size limit (HTTP 413)."""

    status = 413


class ModelNotFound(RequestError):
    """A request for a model this server does not serve (HTTP 404, as OpenAI answers)."""

    status = 404


class RequestFailed(RuntimeError):
    """The engine failed while serving this request (not the others in flight): HTTP 500."""


class EngineDeadError(RuntimeError):
    """An error no request caused, after which the engine cannot step again (a tensor-parallel
    rank died): `step` raises it instead of failing requests one by one."""
