"""The attention pattern of ``by="source"`` where the model returns none: recomputed from its attention call's inputs.

Under sdpa, flash or any attention implementation but eager, transformers' attention module returns no weights,
so the pattern ``A [n, heads, keys]`` at the attributed sites is rebuilt inside the trace from what the attention
function really receives: the module's ``attention_interface(module, query, key, value, attention_mask, ...)``
call, read through nnsight's ``module.source`` (its query ``[batch, heads, q, head_dim]`` and key
``[batch, kv_heads, k, head_dim]`` are after rotary embeddings, q/k norms and any query scale; its mask carries
padding, causality and sliding windows). The score of each site's query row, as transformers'
``eager_attention_forward`` computes it, in float32:

    s = q k^T * scaling  ->  softcap * tanh(s / softcap)  ->  + position_bias  ->  + mask (bool: -inf off it)
    A = softmax([s, sink])[..., :-1]   (attention sinks: a column no source owns, dropped after the softmax)

``None`` masks mean causal (sdpa's ``is_causal``), with the ``sliding_window`` the call names; a 2-d mask is
flash attention's padding mask. Only the sites' query rows are computed (``[n, heads, keys]``, never the whole
``[batch, heads, q, k]``). A call that is missing, or inputs that are not what this expects, raise a ``DLAError``
naming the family; a recomputation that is wrong anyway is caught by the heads rebuilt from it against the output
projection's real input (``SourceReads.pattern_error``, checked in the self-check).
"""

from __future__ import annotations

import torch

from ...errors import DLAError
from ...math.linalg import exact

CALL = "attention_interface"  # the name transformers' attention modules give the attention function they call
ARGUMENTS = ("module", "query", "key", "value", "attention_mask")
# keyword arguments of the call that ``recompute`` applies or that do not change the pattern (the mask carries
# sliding windows under sdpa and eager: ``sliding_window`` is applied only where the mask is None or 2-d), besides
# ``output_*`` flags; MiniMax-M3's sparse ``block_indices`` are in its mask under sdpa (another kernel reads them)
INERT = {"dropout", "scaling", "softcap", "sliding_window", "s_aux", "sinks", "position_bias", "is_causal",
         "position_ids", "use_cache", "cache_position", "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k",
         "max_length_q", "max_length_k", "layer_idx", "target_dtype"}


def implementation(attention) -> str | None:
    """The attention implementation an attention module envoy runs (``"eager"``, ``"sdpa"``, ...), None when its
    module names none (a family with its own attention code, which always returns its weights)."""
    module = getattr(attention, "_module", attention)
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


def returns_weights(attention) -> bool:
    """Whether the attention module returns its pattern as its second output (eager, or its own attention code)."""
    return implementation(attention) in (None, "eager")


def line_of(op) -> str:
    """The source line of an nnsight source operation (``op.text`` is the module's forward, ``op.line`` 1-based)."""
    lines = str(getattr(op, "text", "") or "").splitlines()
    line = int(getattr(op, "line", 0) or 0)
    return lines[line - 1] if 0 < line <= len(lines) else ""


def family_of(attention) -> str:
    """The model type an attention module envoy belongs to (``"llama"``), else its class name: named in errors."""
    module = getattr(attention, "_module", attention)
    return str(getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__)


def attention_call(attention, family: str):
    """The nnsight source operation of ``attention``'s call of its attention function (``attention_interface(``),
    or a ``DLAError`` naming the family when there is not exactly one."""
    try:
        source = attention.source
        names = [n for n in source.names if n.startswith(CALL + "_") and n[len(CALL) + 1:].isdigit()]
        calls = [n for n in names if CALL + "(" in line_of(getattr(source, n))]
    except Exception as error:  # a module whose forward nnsight cannot read
        raise DLAError(f"family {family!r}: by='source' without eager attention reads the attention call inside "
                       f"{type(getattr(attention, '_module', attention)).__name__}.forward, which nnsight cannot read "
                       f"({type(error).__name__}: {error}). Load the model with "
                       "dla_recipes.load(..., attn_implementation='eager')") from error
    if len(calls) != 1:
        raise DLAError(f"family {family!r}: by='source' without eager attention recomputes the pattern from the "
                       f"attention module's {CALL}(...) call, and "
                       f"{type(getattr(attention, '_module', attention)).__name__}.forward has {len(calls)} of them "
                       f"({', '.join(calls) or 'none'}). Load the model with "
                       "dla_recipes.load(..., attn_implementation='eager')")
    return getattr(source, calls[0])


def refuse(family: str, why: str):
    """Raise the ``DLAError`` of a call whose inputs are not what ``recompute`` reads."""
    raise DLAError(f"family {family!r}: by='source' cannot recompute the attention pattern from the attention call's "
                   f"inputs: {why}. Load the model with dla_recipes.load(..., attn_implementation='eager')")


def call_inputs(call, family: str, heads: int) -> dict:
    """The call's inputs by name (``ARGUMENTS`` and its keyword arguments), checked to be what ``recompute`` reads:
    a query ``[batch, heads, q, d]`` and a key ``[batch, kv_heads, k, d]`` with ``kv_heads`` dividing ``heads``."""
    args, kwargs = call.inputs
    named = dict(zip(ARGUMENTS, args))
    named.update({k: v for k, v in kwargs.items()})
    inert = INERT | ({"block_indices"} if implementation(named.get("module")) == "sdpa" else set())
    unknown = sorted(k for k in set(named) - set(ARGUMENTS) - inert if not k.startswith("output_"))
    query, key = named.get("query"), named.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        refuse(family, "its query or key is not a tensor")
    if query.dim() != 4 or key.dim() != 4 or query.shape[1] != heads or heads % key.shape[1] or \
            query.shape[-1] != key.shape[-1] or query.shape[0] != key.shape[0]:
        refuse(family, f"its query {tuple(query.shape)} and key {tuple(key.shape)} are not [batch, {heads} heads, "
                       "positions, head_dim] and [batch, kv_heads, positions, head_dim]")
    if unknown:
        refuse(family, f"the call passes {', '.join(unknown)}, which this recomputation does not know")
    if float(named.get("dropout") or 0.0) != 0.0:
        refuse(family, "attention dropout is on (the model is training)")
    mask = named.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4)):
        refuse(family, f"its attention mask is a {type(mask).__name__}"
                       f"{'' if not isinstance(mask, torch.Tensor) else f' of {mask.dim()} dimensions'}")
    return named


def at_rows(tensor: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """``[n, heads or 1, keys]`` of a ``[batch or 1, heads or 1, q or 1, keys]`` mask or bias at the sites."""
    rows = rows.to(tensor.device) if tensor.shape[0] > 1 else torch.zeros_like(rows, device=tensor.device)
    if positions is None:
        return tensor[rows]
    positions = positions.to(tensor.device) if tensor.shape[2] > 1 else torch.zeros_like(positions, device=tensor.device)
    return tensor[rows, :, positions]


def per_prompt(equation: str, site_side: torch.Tensor, values: torch.Tensor, groups: tuple) -> torch.Tensor:
    """``einsum(equation, site_side[s], values[prompt of s])`` for every site ``s``, one prompt at a time: the values
    ``[batch, keys, kv_heads, head_dim]`` are never copied per site (``[n, keys, ...]`` would grow with the
    positions squared). ``groups``: ``Sites.groups``, each prompt's sites (their indices already on the device:
    nothing is read on the host here)."""
    out = None
    for b, index in groups:
        index = index.to(site_side.device)
        with exact():
            piece = torch.einsum(equation, site_side[index], values[b])
        if out is None:
            out = piece.new_zeros((site_side.shape[0], *piece.shape[1:]))
        out[index] = piece
    return out


def recompute(attention, heads: int, rows: torch.Tensor, positions: torch.Tensor, groups: tuple) -> torch.Tensor:
    """``[n, heads, keys]``: the pattern at the sites (``rows`` / ``positions`` ``[n]``, ``groups`` each prompt's:
    ``Sites``), recomputed from the inputs of ``attention``'s attention call (read here: call it before reading the
    output projection's input)."""
    family = family_of(attention)
    named = call_inputs(attention_call(attention, family), family, heads)
    module, query, key = named.get("module"), named["query"], named["key"]
    mask, bias = named.get("attention_mask"), named.get("position_bias")
    sinks = named.get("s_aux", named.get("sinks"))
    scaling, softcap, window = named.get("scaling"), named.get("softcap"), named.get("sliding_window")
    causal = named.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    rows_q = rows.to(query.device)
    q_len, k_len = query.shape[2], key.shape[2]
    with exact():
        q = query[rows_q, :, positions.to(query.device)].float()  # [n, heads, d]
        kv = key.shape[1]
        keys = key.transpose(1, 2).float()  # [batch, k, kv, d] (a view; each prompt's rows are cast once)
        scores = per_prompt("nvgd,kvd->nvgk", q.view(-1, kv, heads // kv, q.shape[-1]), keys, groups)
        scores = scores.reshape(-1, heads, k_len) * (q.shape[-1] ** -0.5 if scaling is None else float(scaling))
        if softcap is not None:
            scores = torch.tanh(scores / float(softcap)) * float(softcap)
        if isinstance(bias, torch.Tensor):
            scores = scores + at_rows(bias, rows_q, positions)[..., :k_len].float().to(scores.device)
        source = torch.arange(k_len, device=scores.device)[None, :]
        query_at = positions.to(scores.device)[:, None] + (k_len - q_len)  # the query's index among the keys
        allowed = torch.ones(scores.shape[0], k_len, dtype=torch.bool, device=scores.device)
        if mask is not None and mask.dim() == 4:
            rows_mask = at_rows(mask, rows_q, positions)[..., :k_len].to(scores.device)  # [n, heads or 1, keys]
            if rows_mask.dtype == torch.bool:
                scores = scores.masked_fill(~rows_mask, float("-inf"))
            else:
                scores = scores + rows_mask.float()
        else:
            if mask is not None:  # flash attention's [batch, keys] padding mask (1: a real token)
                allowed = allowed & at_rows(mask[:, None, None], rows_q, None)[:, 0, 0, :k_len].bool().to(scores.device)
            if causal and q_len > 1:
                allowed = allowed & (source <= query_at)
            if window is not None:
                allowed = allowed & (query_at - source < int(window))
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        if isinstance(sinks, torch.Tensor):
            sink = sinks.float().to(scores.device).reshape(1, -1, 1).expand(scores.shape[0], heads, 1)
            return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        return torch.softmax(scores, -1)
