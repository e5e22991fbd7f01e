"""When a request's new tokens end it: the stop conditions the scheduler applies token by token."""

from __future__ import annotations

from core_engine.core.request import Request, RequestStatus


def append_until_stop(
    request: Request, sampled_token_ids: list[int], max_model_len: int
) -> list[int]:
    """Appends the tokens one by one and stops at the first that ends the request (a run of
    accepted drafts included); returns the tokens appended."""
    new_token_ids = []
    for token_id in sampled_token_ids:
        request.append_output_token_ids(token_id)
        new_token_ids.append(token_id)
        if check_stop(request, max_model_len):
            break
    return new_token_ids


def check_stop(request: Request, max_model_len: int) -> bool:
    """Sets a finished status if the request's last token ends it.

    From min_tokens on, eos (unless ignore_eos) and stop_token_ids are checked before the
    length limits: a request whose last allowed token is eos finished because of the eos.
    Then the length limits (max_tokens, max_model_len).
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    max_tokens = request.max_tokens
    if request.num_tokens >= max_model_len or (
        max_tokens is not None and request.num_output_tokens >= max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
