"""Clear errors for models nnterp cannot load: the model type, the standardized module it could not find, the fix.

nnterp's ``StandardizedTransformer`` finds each model's blocks, final norm, head, attention and MLP by name; when it
cannot, its own error says little (``'StandardizedTransformer' object has no attribute 'layers'``). ``load_error``
turns that into a ``LoadError`` naming the model type, the missing module, and a ``RenameConfig`` to try, built
from the modules the model really has.
"""

from __future__ import annotations

import torch

from ..errors import LoadError
from ..families import text_config

# The standardized modules nnterp looks for, the RenameConfig field naming each, and what the module is.
_STANDARD = {
    "layers": ("layers_name", "the list of decoder blocks"),
    "ln_final": ("ln_final_name", "the final norm"),
    "lm_head": ("lm_head_name", "the output head"),
    "self_attn": ("attn_name", "each block's attention"),
    "mlp": ("mlp_name", "each block's MLP"),
}


def _missing_module(error: BaseException) -> str | None:
    """The standardized module an nnterp load error says it could not find (None: another failure)."""
    import re

    text = str(error)
    match = re.search(r"'StandardizedTransformer' object.* has (?:no )?attribute '(\w+)'", text)
    match = match or re.search(r"Could not find (\w+) module", text)
    return match.group(1) if match and match.group(1) in _STANDARD else None


def _torch_model(model):
    """The ``torch.nn.Module`` behind ``model`` (a model object, or one built on the meta device from a name)."""
    if isinstance(model, torch.nn.Module):
        return model
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    except Exception:  # noqa: BLE001 - no module tree to search: the error says less
        return None


def _candidates(root, missing: str) -> list[str]:
    """Module paths in ``root`` that could be the standardized ``missing`` module (for the suggested rename)."""
    modules = dict(root.named_modules())
    lists = [n for n, m in modules.items() if isinstance(m, torch.nn.ModuleList) and len(m)]
    lists = [n for n in lists if not any(n.startswith(other + ".") for other in lists)]  # outermost lists only
    longest = max((len(modules[n]) for n in lists), default=0)
    blocks = [n for n in lists if len(modules[n]) == longest]
    if missing == "layers":
        return blocks
    outside = {n: m for n, m in modules.items() if n and not any(n == b or n.startswith(b + ".") for b in lists)}
    if missing == "ln_final":
        norms = [n for n, m in outside.items() if "norm" in type(m).__name__.lower()]
        return norms[-1:]
    if missing == "lm_head":
        vocab = getattr(getattr(root, "config", None), "vocab_size", None)
        return [n for n, m in outside.items() if isinstance(m, torch.nn.Linear) and m.out_features == vocab][-1:]
    if not blocks:
        return []
    words = ("attention", "attn") if missing == "self_attn" else ("mlp", "moe", "feedforward", "feed_forward", "ffn")
    children = modules[blocks[0]][0].named_children()
    return [n for n, m in children if any(w in (n + type(m).__name__).lower() for w in words)][:1]


def load_error(model, error: BaseException) -> LoadError:
    """A ``LoadError`` for an nnterp load failure: the model type, what nnterp could not find, and the fix."""
    root = _torch_model(model)
    config = getattr(root, "config", None)
    model_type = getattr(text_config(config) if config is not None else None, "model_type", None) or "unknown"
    name = type(root).__name__ if root is not None else str(model)
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if error.__cause__ is not None:  # nnterp wraps the failure of its input/output check
        inner = error.__cause__
        cause += f" <- {type(inner).__name__}: {(str(inner).strip().splitlines() or [''])[0]}"
    missing = _missing_module(error)
    if missing is None:
        hint = ("nnterp's check of the blocks' inputs and outputs failed; if the blocks' modules are named as nnterp "
                "expects, load(model, check_renaming=False) skips it" if "check the IO" in cause else
                "dla_recipes attributes the models nnterp loads as a StandardizedTransformer")
        return LoadError(f"nnterp could not load this {model_type!r} model ({name}): {type(error).__name__}: "
                         f"{cause}. {hint[0].upper() + hint[1:]}.")
    field, what = _STANDARD[missing]
    candidates = _candidates(root, missing) if root is not None else []
    if not candidates:
        fix = (f"this model has no module that could be {what}, so nnterp cannot load it as a "
               "StandardizedTransformer (and dla_recipes cannot attribute it)")
    else:
        example = f"nnterp.rename_utils.RenameConfig({field}={candidates[0]!r})"
        fix = (f"if {candidates[0]!r} is {what}, load it with dla_recipes.load(model, rename_config={example})"
               if len(candidates) == 1 else
               f"it has several candidates ({', '.join(map(repr, candidates))}); nnterp expects one. If one of them "
               f"is {what}, load it with dla_recipes.load(model, rename_config={example}) (naming that one)")
    return LoadError(
        f"nnterp could not load this {model_type!r} model ({name}): it found no {missing!r} module ({what}; "
        f"nnterp said: {cause}). {fix[0].upper() + fix[1:]}."
    )
