"""``LLM``: offline batched generation on top of :class:`LLMEngine` (vLLM's class of the same
name and signature)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from nybble.config import EngineConfig
from nybble.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from nybble.runtime.llm_engine import LLMEngine
from nybble.tokenizer.tokenizer import Tokenizer
from nybble.lora_request import LoRARequest
from nybble.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | list[int] | dict[str, Any]


def _normalise(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    """Accept a string, a token-id list, a list of either, or ``{"prompt_token_ids": ...}``."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]  # type: ignore[arg-type]
    out: list[str | list[int]] = []
    for p in prompts:  # type: ignore[union-attr]
        if isinstance(p, dict):
            p = p.get("prompt_token_ids", p.get("prompt"))
        if not isinstance(p, (str, list)):
            raise TypeError(f"prompt must be a string, a list of token ids or a dict, got "
                            f"{type(p).__name__}")
        out.append(p)
    return out


def _beam_sequence(prompt_ids: list[int], out: CompletionOutput, length_penalty: float,
                   tokenizer: Tokenizer) -> BeamSearchSequence:
    tokens = prompt_ids + out.token_ids
    cum = out.cumulative_logprob if out.cumulative_logprob is not None else 0.0
    return BeamSearchSequence(tokens=tokens, cum_logprob=cum,
                              score=cum / len(out.token_ids) ** length_penalty,
                              text=tokenizer.decode(tokens, skip_special_tokens=True),
                              finish_reason=out.finish_reason, stop_reason=out.stop_reason)


class LLM:
    """Offline inference: ``LLM(model, **engine_args).generate(prompts, sampling_params)``.

    Args:
        model: Hugging Face model folder; ``None`` for the bundled stories260k model.
        **engine_args: any :class:`nybble.config.EngineConfig` field by its flat name
            (``max_num_seqs``, ``num_gpu_blocks``, ``dtype``, ``block_size``...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(model, **engine_args)
        self._counter = 0

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """Build from an already validated :class:`EngineConfig` (what the CLI does)."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config)
        llm._counter = 0
        return llm

    def shutdown(self) -> None:
        """End this LLM's engine: unfinished requests are aborted, tensor-parallel workers
        stopped and their process group destroyed, so another ``LLM`` (also with
        ``tensor_parallel_size`` > 1) can start in this process. Idempotent; also what
        leaving a ``with LLM(...) as llm:`` block does. Later calls to generate raise
        ``RuntimeError``."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt with continuous batching; outputs keep the input order.

        Args:
            prompts: text, token ids, or a list of them.
            sampling_params: one for all prompts or one per prompt (default:
                ``SamplingParams()``).
            use_tqdm: show a progress bar over finished requests.
            lora_request: the LoRA adapter of every prompt, or one per prompt (``None``: the
                base model); needs ``LLM(..., enable_lora=True)``. Prompts of different
                adapters run in one batch.

        Raises:
            InvalidRequestError: a prompt or parameter is invalid (nothing is run then).
            EngineStepError: an engine step failed for some of these requests; the others
                are aborted too, and the engine stays usable.
        """
        items = _normalise(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(items) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(items):
            raise ValueError(f"sampling_params must be one or {len(items)} items, got "
                             f"{len(params)}")
        loras = ([lora_request] * len(items) if lora_request is None or
                 isinstance(lora_request, LoRARequest) else list(lora_request))
        if len(loras) != len(items):
            raise ValueError(f"lora_request must be one or {len(items)} items, got "
                             f"{len(loras)}")
        return self._run(items, params, use_tqdm, loras)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Generate the answer to a conversation, or to each of several (vLLM's
        ``LLM.chat``): rendered with the chat template exactly as the server renders a chat
        completion (:mod:`nybble.tokenizer.chat_messages`), so with the same sampling the
        output is the server's.

        Args:
            messages: one conversation (OpenAI chat messages, assistant ``tool_calls`` and
                ``tool`` messages included) or a list of them.
            sampling_params: one for all conversations or one per conversation.
            use_tqdm: show a progress bar.
            chat_template: a jinja2 template replacing the model's.
            add_generation_prompt, continue_final_message: as in transformers'
                ``apply_chat_template`` (not both).
            tools: function specs for the template's ``tools`` variable
                (``[{"type": "function", "function": {"name", "parameters", ...}}]``).
            chat_template_kwargs: extra template variables (e.g. ``enable_thinking``).
            lora_request: the LoRA adapter of every conversation, or one per conversation
                (as in :meth:`generate`).

        Returns:
            One :class:`RequestOutput` per conversation (the raw text: tool-call markup is
            not parsed here, as in vLLM).

        Raises:
            InvalidRequestError: no chat template, the template refused a conversation, a
                tool call's arguments are not a JSON object, or a prompt or parameter the
                request gate refuses.
        """
        from nybble.tokenizer.chat_messages import template_messages

        batch = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in batch:
            prompts.append(tok.encode_conversation(
                template_messages(list(conversation)),  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                template_kwargs=chat_template_kwargs, tools=tools))
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``), batched with continuous
        batching: one forward per step for every live beam of every prompt; the beams share
        KV blocks (fork, copy-on-write) and pruned beams free theirs at once.

        The rule is transformers' (``generate(num_beams=beam_width, do_sample=False,
        length_penalty=..., early_stopping=...)``); see docs/serving.md ("Beam search")
        and :mod:`nybble.runtime.engine.beam_search`.

        Args:
            prompts: text, token ids, or a list of them.
            params: the search's parameters.
            use_tqdm: show a progress bar over finished prompts.

        Returns:
            One :class:`BeamSearchOutput` per prompt, its ``beam_width`` sequences best
            score first.

        Raises:
            InvalidRequestError: (a ``ValueError``) a parameter out of range, naming it
                (``beam_width``, ``max_tokens``, ``temperature``, ``length_penalty``,
                ``early_stopping``), or a prompt that cannot fit.
            EngineStepError: an engine step failed for some of these requests.
        """
        items = _normalise(prompts)
        outs = self._run(items, [params.to_sampling_params()] * len(items), use_tqdm)
        tok = self.get_tokenizer()
        return [BeamSearchOutput([_beam_sequence(o.prompt_token_ids, c, params.length_penalty,
                                                 tok) for c in o.outputs]) for o in outs]

    def _run(self, items: list[str | list[int]], params: list[SamplingParams],
             use_tqdm: bool, loras: list[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Add every request, step until they all finished; outputs keep the input order."""
        engine = self.llm_engine
        engine.check_open()
        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(items, params)):
                ids.append(str(self._counter))
                self._counter += 1
                engine.add_request(ids[-1], prompt, p,
                                   lora_request=None if loras is None else loras[i])
            with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            final[out.request_id] = out
                            bar.update(1)
        except BaseException:  # NOTE: a bad request, a failed step or Ctrl-C: end them all
            engine.abort_request([i for i in ids if i not in final])
            raise
        return [final[i] for i in ids]
