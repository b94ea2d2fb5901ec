"""Small helpers of the scheduler: the per-token stop check and batched list removal."""

from __future__ import annotations

from engine_core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Check the request's newest token. Order: EOS, stop token ids, then length limits.

    While fewer than min_tokens outputs exist, EOS and stop ids do not stop the request (the
    sampler masks them too). Sets the finished status and, for a stop id, ``stop_reason``.
    """
    sampling_params = request.sampling_params
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    if num_output_tokens >= sampling_params.min_tokens:
        last_token_id = output_token_ids[-1]
        if not sampling_params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if sampling_params.stop_token_ids and last_token_id in sampling_params.stop_token_set:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if num_output_tokens >= sampling_params.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def remove_all(requests: list[Request], to_remove: set[Request]) -> list[Request]:
    """A new list without ``to_remove``: one pass instead of one linear scan per removal."""
    if len(to_remove) == 1:
        (only,) = to_remove
        out = list(requests)
        out.remove(only)
        return out
    return [r for r in requests if r not in to_remove]
