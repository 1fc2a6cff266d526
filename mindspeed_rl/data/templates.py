"""Prompt templates (`prompt_type`): from a dataset row's prompt to the token ids the model completes.

Two kinds of template:
- ``chat``: the tokenizer's own chat template (``apply_chat_template`` with ``add_generation_prompt``),
  the way an instruct checkpoint was trained to be prompted;
- a named MindSpeed-RL template (``empty``, ``qwen_r1``, ``qwen_math_r1``) from
  ``configs/prompt_templates.yaml``, rendered as MindSpeed-RL's ``Template._encode`` renders one turn:
  system piece (the row's system text, else the template's default) then the user piece, each piece
  tokenized on its own (``add_special_tokens=False``) and the ids concatenated.

A prompt is either a string (one user turn) or a list of chat messages ``[{"role", "content"}]``
(DAPO-Math-17k's schema): an optional leading system message, then user / assistant turns ending
with a user turn.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional


from mindspeed_rl.errors import ConfigError
from mindspeed_rl.registries import (  # noqa: F401 (known_prompt_types: API)
    CHAT_PROMPT_TYPE, PROMPT_TYPE_KEY, TEMPLATES_FILE, check_prompt_type, known_prompt_types, template_entries)

CONTENT_SLOT = "{{content}}"


class PromptFormatError(ValueError):
    """A row's prompt is not a string or a valid message list; the caller adds file and row."""


@dataclass(frozen=True, kw_only=True)
class PromptTemplate:
    """One entry of ``configs/prompt_templates.yaml``; the ``{{content}}`` slot takes the text."""

    name: str
    user: str
    system: str = CONTENT_SLOT
    assistant: str = CONTENT_SLOT
    separator: str = ""
    default_system: str = ""

    def __post_init__(self) -> None:
        for field_name in ("user", "system", "assistant"):
            if CONTENT_SLOT not in getattr(self, field_name):
                raise ConfigError(
                    PROMPT_TYPE_KEY, f"template {self.name!r} in {TEMPLATES_FILE}: {field_name} lacks {CONTENT_SLOT}"
                )

    def pieces(self, messages: Sequence[Mapping[str, str]], system: Optional[str]) -> list[str]:
        """The text pieces MindSpeed-RL tokenizes one by one (system only before the first turn)."""
        system_text = system or self.default_system
        pieces = [self.system.replace(CONTENT_SLOT, system_text)] if system_text else []
        for index, message in enumerate(messages):
            if index > 0 and index % 2 == 0:
                pieces.append(self.separator)
            slot = self.user if message["role"] == "user" else self.assistant
            pieces.append(slot.replace(CONTENT_SLOT, message["content"]))
        return [piece for piece in pieces if piece]


def check_tokenizer_supports(prompt_type: str, tokenizer, *, key: str = PROMPT_TYPE_KEY) -> None:
    """``chat`` needs a tokenizer that carries a chat template; named templates work with any."""
    check_prompt_type(prompt_type, key=key)
    if prompt_type == CHAT_PROMPT_TYPE and not getattr(tokenizer, "chat_template", None):
        where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            key, f"'chat' uses the tokenizer's own chat template, but the tokenizer at {where} has none "
                 f"(no chat_template in tokenizer_config.json nor chat_template.jinja); "
                 f"pick a named template: {', '.join(t for t in known_prompt_types() if t != CHAT_PROMPT_TYPE)}"
        )


def render_prompt(prompt, *, tokenizer, prompt_type: str, system: str | None = None,
                  key: str = PROMPT_TYPE_KEY) -> list[int]:
    """Token ids of ``prompt`` (a string or a chat-message list) under the template ``prompt_type``."""
    return render_prompt_with_text(prompt, tokenizer=tokenizer, prompt_type=prompt_type, system=system, key=key)[1]


def render_prompt_with_text(prompt, *, tokenizer, prompt_type: str, system: str | None = None,
                            key: str = PROMPT_TYPE_KEY) -> tuple[str, list[int]]:
    """(rendered text, token ids); the text is for logging, the ids are what the model sees.

    Raises ConfigError (at ``key``) for an unknown template or ``chat`` without a chat template, and
    PromptFormatError for a malformed prompt (the caller knows the file and row to name)."""
    check_tokenizer_supports(prompt_type, tokenizer, key=key)
    system, messages = prompt_messages(prompt, system)
    if prompt_type == CHAT_PROMPT_TYPE:
        chat = ([{"role": "system", "content": system}] if system else []) + messages
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return text, tokenizer.encode(text, add_special_tokens=False)
    pieces = _named_templates()[prompt_type].pieces(messages, system)
    token_ids = [token_id for piece in pieces for token_id in tokenizer.encode(piece, add_special_tokens=False)]
    return "".join(pieces), token_ids


def prompt_messages(prompt: Any, system: Optional[str]) -> tuple[Optional[str], list[dict[str, str]]]:
    """(system text, user/assistant turns) from a string or a message list; checks the turn order.
    Raises PromptFormatError for anything else."""
    if isinstance(prompt, str):
        return system, [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not prompt:
        raise PromptFormatError(f"prompt must be a string or a non-empty list of chat messages, got {prompt!r:.80}")
    messages = []
    for message in prompt:
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise PromptFormatError(f"each chat message needs string 'role' and 'content', got {message!r:.80}")
        messages.append({"role": message["role"], "content": message["content"]})
    if messages[0]["role"] == "system":
        if system:
            raise PromptFormatError("the prompt has a system message and map_keys.system gives another")
        system, messages = messages[0]["content"], messages[1:]
    expected = ["user" if index % 2 == 0 else "assistant" for index in range(len(messages))]
    if not messages or [m["role"] for m in messages] != expected or expected[-1] != "user":
        raise PromptFormatError(
            f"chat messages must alternate user/assistant from a user turn and end with a user turn, "
            f"got roles {[m['role'] for m in prompt]}"
        )
    return system, messages


@functools.cache
def _named_templates() -> dict[str, PromptTemplate]:
    return {name: PromptTemplate(name=name, **fields) for name, fields in template_entries().items()}


def named_template(name: str) -> PromptTemplate:
    """The template ``name`` of configs/prompt_templates.yaml (a demo builds its vocabulary from its texts)."""
    check_prompt_type(name)
    return _named_templates()[name]
