"""`ParameterError`: a request parameter the engine cannot serve, with the parameter's name."""

from __future__ import annotations


class ParameterError(ValueError):
    """A request parameter the engine cannot serve. `param` names the request field at fault
    (the `param` of OpenAI's error body: "max_tokens", "stop_token_ids", "prompt"); the message
    names the value and the limit it broke.

    Raised where the value is checked (SamplingParams, the request's fit to the model), so
    nobody has to recover the field from the message's text.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
