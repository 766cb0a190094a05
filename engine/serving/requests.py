"""Wire requests -> the core's :class:`EngineRequest`: model check, chat template and tokenisation.

This runs in the server's request handler (in a worker thread, see
:meth:`EngineThread.generate`), not on the step thread, so templating and encoding
long prompts do not hold up the forward pass.
"""

from __future__ import annotations

from engine.core.outputs import EngineRequest, ErrorKind, RequestError, SamplingParams
from engine.tokenizer import Tokenizer
from protocol.rpc import GenerateRequest
from protocol.rpc import SamplingParams as WireSamplingParams


def sampling_params(wire: WireSamplingParams) -> SamplingParams:
    """The core's sampling parameters from the RPC's (already validated) ones."""
    return SamplingParams(
        max_tokens=wire.max_tokens,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        min_p=wire.min_p,
        repetition_penalty=wire.repetition_penalty,
        presence_penalty=wire.presence_penalty,
        frequency_penalty=wire.frequency_penalty,
        seed=wire.seed,
        stop=tuple(wire.stop),
        stop_token_ids=tuple(wire.stop_token_ids),
        ignore_eos=wire.ignore_eos,
        logprobs=wire.logprobs,
        top_logprobs=wire.top_logprobs,
        n=wire.n,
    )


def check_model(request: GenerateRequest, model_name: str) -> None:
    """Refuse a request for another model (checked before any tokenising)."""
    if request.model is not None and request.model != model_name:
        raise RequestError(
            f"The model '{request.model}' does not exist; this engine serves '{model_name}'.",
            kind=ErrorKind.MODEL_NOT_FOUND,
            param="model",
        )


def tokenize(request: GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: chat messages through the template, text encoded, ids as given."""
    if request.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        try:
            return tokenizer.encode_chat(messages)
        except Exception as exc:  # template errors are the caller's input problem
            raise RequestError(f"could not apply the chat template: {exc}", param="messages") from exc
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt)
    return list(request.prompt or [])


def engine_request(request: GenerateRequest, tokenizer: Tokenizer, *, model_name: str) -> EngineRequest:
    """Check and tokenise a wire request; raises :class:`RequestError` for bad input."""
    check_model(request, model_name)
    return EngineRequest(
        request_id=request.request_id,
        prompt_token_ids=tokenize(request, tokenizer),
        sampling=sampling_params(request.sampling),
        cache_namespace=request.cache_namespace,
        deadline=request.deadline,
    )
