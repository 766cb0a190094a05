"""Wire requests -> the core's :class:`EngineRequest`: model check, chat template and tokenisation.

This runs in the server's request handler (in a worker thread, see
:meth:`EngineThread.generate`), not on the step thread, so templating and encoding
long prompts do not hold up the forward pass.
"""

from __future__ import annotations

from dataclasses import fields

from engine.core.outputs import EngineRequest, ErrorKind, RequestError, SamplingParams
from engine.tokenizer import Tokenizer
from protocol.rpc import GenerateRequest
from protocol.rpc import SamplingParams as WireSamplingParams


def sampling_params(wire: WireSamplingParams) -> SamplingParams:
    """The core's sampling parameters from the RPC's (already validated) ones: same names, lists
    as tuples (the core's are frozen)."""
    values = {f.name: getattr(wire, f.name) for f in fields(SamplingParams)}
    return SamplingParams(**values | {"stop": tuple(wire.stop), "stop_token_ids": tuple(wire.stop_token_ids)})


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
