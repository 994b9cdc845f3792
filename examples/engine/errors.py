"""The one error a request can be refused with: which field is wrong, and why."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot serve as asked; `param` names the offending field.

    The server answers it with HTTP 400 and the message; it never reaches the model.
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
