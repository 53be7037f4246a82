"""Request bodies of the OpenAI-compatible endpoints (pydantic; they are also the OpenAPI schema).

Fields OpenAI defines and we honour keep OpenAI's names and ranges; the extra sampling fields vLLM
accepts (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``num_speculative_tokens``, and the
structured-output extras ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``) are
accepted too; ``response_format`` is accepted by both endpoints, as vLLM does. Fields we do not
implement are accepted only at their neutral value (e.g. ``echo=false``, ``tools`` empty) and refused
with a 400 otherwise, rather than silently ignored. Unknown fields are ignored, as OpenAI's own server
does for forward compatibility.

Types are strict (pydantic strict mode): ``"stream": "yes"``, ``"max_tokens": true`` or ``"n": "2"`` are
400s, not coerced; an integer where a number is expected (``"temperature": 1``) is still a number.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

NonEmptyStr = Annotated[str, StringConstraints(min_length=1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopField = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = Field(None, description="the served model's name (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")
    user: str | None = None
    # extras (vLLM's names)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1, description="extra: keep the k most likely tokens")
    min_p: float = Field(0.0, ge=0, le=1, description="extra")
    repetition_penalty: float = Field(1.0, gt=0, le=100, description="extra")
    ignore_eos: bool = Field(False, description="extra")
    skip_special_tokens: bool = Field(True, description="extra: leave special tokens out of the text")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64, description="extra")
    use_beam_search: bool = Field(False, description="extra: not supported by the server (must be false); "
                                                     "beam search runs offline, engine.LLM.beam_search")
    num_speculative_tokens: int | None = Field(
        None, ge=0, le=16, description="extra: n-gram draft tokens verified per step (0: off; omitted: the "
                                       "deployment's default); lossless")
    # structured output (engine/structured.py): at most one of these
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': {'name', 'schema', "
                          "'strict'}}")
    guided_json: dict[str, Any] | str | None = Field(None, description="extra: a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="extra: a regular expression the output matches")
    guided_choice: list[str] | None = Field(None, description="extra: the output is one of these strings")
    guided_grammar: str | None = Field(None, description="extra: an EBNF grammar (root rule 'root')")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: (NonEmptyStr
             | Annotated[list[NonEmptyStr], Field(min_length=1, max_length=256)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[TokenIds], Field(min_length=1, max_length=256)])
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="not supported: must be false")
    best_of: int | None = Field(None, ge=1, le=128, description="accepted only when equal to n")
    suffix: str | None = Field(None, description="not supported: must be empty")


class TextContentPart(BaseModel):
    """A ``{"type": "text", "text": ...}`` part of a message's content."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextContentPart], Field(max_length=256)] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: must be empty")
    tool_choice: Any = Field(None, description="not supported")
