"""What ``attribute_generation`` is given, checked before anything runs: the prompts (texts, token ids or chat
messages through the tokenizer's chat template) and the generation's settings (``max_new_tokens``, transformers'
``generate`` options, the seed of a sampled answer), every bad item of a call named in ONE ``InputError``.

``prompt_ids`` turns the prompts into each prompt's own token ids, ``[n][P_b]``: a text as ``attribute`` tokenizes it
(the tokenizer's special tokens added), token ids as given, and a conversation (a list of ``{"role", "content"}``
dicts, or a list of such conversations for a batch) rendered by ``tokenizer.apply_chat_template(...,
add_generation_prompt=True)`` and tokenized without adding special tokens again (the template writes them). What the
model then generates is the assistant's turn: only those tokens are attributed.
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from ..args import check_prompts
from ..errors import InputError

# generate() options the call sets itself (it reads each step's logits and the ids from them).
OWN = ("output_logits", "return_dict_in_generate", "max_new_tokens", "streamer")


@dataclass(frozen=True)
class Settings:
    """How the answer is generated.

    Attributes:
        max_new_tokens: the most tokens generated a prompt (an EOS ends a row before).
        options: transformers ``generate`` keyword arguments besides it, as sorted ``(name, value)`` pairs.
        seed: the seed the sampler ran from (``do_sample=True``), or None (greedy: no randomness).
    """

    max_new_tokens: int
    options: tuple = ()
    seed: int | None = None

    @property
    def sampled(self) -> bool:
        return bool(dict(self.options).get("do_sample", False))

    def kwargs(self, edited: bool = False) -> dict:
        """The keyword arguments of ``model.generate``: these settings, and each step's raw logits returned;
        ``edited`` (an ``intervene`` edit runs at every step): no KV cache, so every step is a forward pass over the
        whole prefix and an edit that indexes positions edits the same ones at every step."""
        return {**dict(self.options), "max_new_tokens": self.max_new_tokens, "output_logits": True,
                "return_dict_in_generate": True, **({"use_cache": False} if edited else {})}


def is_message(value) -> bool:
    return isinstance(value, Mapping) and "role" in value


def conversations(prompts) -> list[list] | None:
    """The prompts as conversations when they are chat messages (one conversation, a list of message dicts, or a
    list of conversations), else None."""
    if isinstance(prompts, (list, tuple)) and prompts and all(is_message(m) for m in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)) and prompts and all(
            isinstance(c, (list, tuple)) and c and all(is_message(m) for m in c) for c in prompts):
        return [list(c) for c in prompts]
    return None


def chat_problems(tokenizer, chats: list[list]) -> list[str]:
    """What is wrong with ``chats`` for this tokenizer: no chat template, a message without a string ``content``."""
    problems = []
    if getattr(tokenizer, "chat_template", None) is None:
        problems.append("the prompts are chat messages, but the tokenizer has no chat template "
                        "(tokenizer.chat_template is None): give plain text prompts, or set tokenizer.chat_template "
                        "to a Jinja template")
    for i, chat in enumerate(chats):
        for j, message in enumerate(chat):
            if not isinstance(message.get("content"), str) or not isinstance(message.get("role"), str):
                problems.append(f"conversation {i}, message {j} ({message!r}): give {{'role': str, 'content': str}}")
    return problems


def prompt_ids(tokenizer, prompts, problems: list[str]) -> tuple[list[tuple[int, ...]], bool]:
    """``([n][P_b] own token ids, chat)``; problems are appended to ``problems`` (the caller raises them all)."""
    chats = conversations(prompts)
    if chats is None:
        checked = check_prompts(prompts)
        texts = [p for p in checked if isinstance(p, str)]
        encoded = iter(tokenizer(texts)["input_ids"] if texts else [])
        ids = [tuple(next(encoded)) if isinstance(p, str) else tuple(p) for p in checked]
        chat = False
    else:
        found = chat_problems(tokenizer, chats)
        problems += found
        if found:
            return [], True
        rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        ids = [tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in rendered]
        chat = True
    problems += [f"prompt {i} has no tokens: give it some text" for i, row in enumerate(ids) if not row]
    return ids, chat


def check_settings(generation_config, max_new_tokens, generate, seed, problems: list[str]) -> Settings | None:
    """The ``Settings`` of a call, or None with ``problems`` appended: ``max_new_tokens`` a positive int,
    ``generate`` a dict of options transformers' ``GenerationConfig`` knows and validates (``generation_config``:
    the model's own, updated with them), no beam search (its tokens are not one step's choice), ``seed`` an int."""
    before = len(problems)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        problems.append(f"max_new_tokens={max_new_tokens!r}: give an int >= 1 (the most tokens generated a prompt)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        problems.append(f"seed={seed!r}: give an int (the sampler's seed) or None")
    options = {} if generate is None else generate
    if not isinstance(options, Mapping):
        problems.append(f"generate={generate!r}: give a dict of transformers generate() options, e.g. "
                        "dict(do_sample=True, temperature=0.7)")
        options = {}
    own = sorted(set(options) & set(OWN))
    if own:
        problems.append(f"generate={{{', '.join(map(repr, own))}: ...}}: attribute_generation sets "
                        f"{', '.join(own)} itself" + (" (give max_new_tokens= to the call)"
                                                      if "max_new_tokens" in own else ""))
    options = {k: v for k, v in options.items() if k not in OWN}
    for name in ("num_beams", "num_return_sequences"):
        if options.get(name, 1) != 1:
            problems.append(f"generate={{'{name}': {options[name]!r}}}: one answer a prompt, chosen step by step "
                            f"(beam search keeps tokens no single step chose): leave {name} at 1")
    config = copy.deepcopy(generation_config)
    if config is not None:
        strict = validates(config)  # a checkpoint's own config that transformers only warns about stays allowed
        unknown = config.update(**options)
        if unknown:
            problems.append(f"generate={{{', '.join(map(repr, sorted(unknown)))}: ...}}: not a generate() option "
                            "transformers knows (see transformers.GenerationConfig)")
        try:
            config.validate(strict=strict)
        except ValueError as error:  # transformers' own verdict on the options
            problems.append(f"generate={options!r}: transformers refuses these options: {error}")
    sampled = bool(getattr(config, "do_sample", False)) if config is not None else bool(options.get("do_sample"))
    if sampled:
        problems += sampler_problems(options)
    if len(problems) > before:
        return None
    sampled = bool(getattr(config, "do_sample", False)) if config is not None else bool(options.get("do_sample"))
    if sampled and seed is None:
        import torch

        seed = int(torch.randint(0, 2 ** 31 - 1, ()))  # drawn from the caller's generator, and recorded
    options = {**options, "do_sample": sampled}
    return Settings(int(max_new_tokens), tuple(sorted(options.items())), None if not sampled else int(seed))


def validates(config) -> bool:
    """Whether ``config`` (a ``GenerationConfig``) passes transformers' strict validation as it is."""
    try:
        copy.deepcopy(config).validate(strict=True)
    except ValueError:
        return False
    return True


def sampler_problems(options: Mapping) -> list[str]:
    """The sampling options transformers' samplers refuse (each sampler checks its value when it is built, at
    generate time; ``GenerationConfig.validate`` does not): a temperature <= 0, a top_p outside (0, 1], ..."""
    import transformers

    found = []
    for name, sampler, off in (("temperature", "TemperatureLogitsWarper", 1.0), ("top_p", "TopPLogitsWarper", 1.0),
                               ("top_k", "TopKLogitsWarper", 0), ("min_p", "MinPLogitsWarper", None),
                               ("typical_p", "TypicalLogitsWarper", 1.0)):  # off: the value generate builds none for
        if options.get(name) not in (None, off) and hasattr(transformers, sampler):
            try:
                getattr(transformers, sampler)(options[name])
            except (ValueError, TypeError) as error:
                found.append(f"generate={{{name!r}: {options[name]!r}}}: transformers refuses it: {error}")
    return found


def raise_all(problems: list[str]) -> None:
    """One ``InputError`` naming every problem of the call."""
    if len(problems) == 1:
        raise InputError(problems[0])
    if problems:
        raise InputError(f"{len(problems)} problems with this attribute_generation call:\n  " + "\n  ".join(problems))
