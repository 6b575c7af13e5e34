"""In-trace readers: the values a DLA recipe speaks of, the same on every family.

Call these inside ``with model.trace(...)`` on a ``StandardizedTransformer``, in forward order (a block's input,
its attention, its MLP, its output). Each returns a live value of the running forward pass:

- ``layer_input(model, i)``             ``[batch, pos, d_model]`` the residual stream entering block ``i``
- ``attention_output(model, i)``        ``[batch, pos, d_model]`` what block ``i``'s attention adds to the stream
- ``attention_head_outputs(model, i)``  ``[batch, pos, heads, head_dim]`` the heads, as the output projection reads them
- ``mlp_output(model, i)``              ``[batch, pos, d_model]`` what block ``i``'s MLP adds to the stream
- ``neuron_activations(model, i)``      ``[batch, pos, d_mlp]`` the MLP's neurons, as its down projection reads them
- ``layer_output(model, i)``            ``[batch, pos, d_model]`` the residual stream leaving block ``i``

"What a sublayer adds" is read where the family table (``dla_recipes.families``) says: a post-norm's output on Gemma 2/3,
the output times ``residual_multiplier`` on Granite, the dense projection on BLOOM (whose modules add the residual
inside themselves), a copy on Falcon (which later adds the attention into the MLP's output in place), and so on.
The names follow nnterp's next vocabulary, so a recipe written with them reads like one written for it.

The site primitives the recipe reads with live here too: ``read_site`` (a module's input or output below a block),
``at`` (a value at the attributed positions, copied in float32), ``frozen_at`` (a norm frozen at its real input
there) and ``param`` (a parameter in float32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InputError
from ..families import Heads, Routed, Term, family_of, text_config
from ..math.frozen_norm import FrozenNorm, probe_norm
from ..plan.build import layer_terms, module_at, scalar


def read_site(layer, site: str, batch_size: int | None = None):
    """The value at ``site`` (``"<path>.output"`` / ``"<path>.input"``) below a block envoy; a tuple's first element.

    ``batch_size`` unflattens a module that sees ``[batch * pos, ...]`` (OPT's MLP) back to ``[batch, pos, ...]``.
    """
    path, io = site.rsplit(".", 1) if "." in site else ("", site)
    envoy = module_at(layer, path) if path else layer
    value = getattr(envoy, io)
    value = value[0] if isinstance(value, (tuple, list)) else value
    if batch_size is not None and value.dim() == 2:
        value = value.unflatten(0, (batch_size, -1))
    return value


class Sites(NamedTuple):
    """The attributed (prompt, position) pairs of one batch, one row of every read each: ``rows`` ``[n]`` each
    site's prompt (its row of the batch), ``positions`` ``[n]`` its index into the padded sequence, ``batch`` the
    prompts in the batch (the leading size of every activation). One position per prompt: ``rows = arange(batch)``.

    ``flat`` ``[n]``: ``rows * seq + positions`` for values ``[batch, seq, ...]`` (``seq`` the padded length), on
    the device, computed once (``Sites.on``) so that no read copies an index to the device: a copy from host
    memory makes the host wait for the device, as a read of a result does.

    ``groups``: ``((prompt, index [k] on the device), ...)``, the sites of each prompt, for work done one prompt at
    a time (``by="source"``: ``kinds.pattern.per_prompt``); built on the host with the sites (``Sites.grouped``),
    so that no read on the host of the rows is needed in the trace."""

    rows: torch.Tensor
    positions: torch.Tensor
    batch: int
    flat: torch.Tensor | None = None
    seq: int = -1
    groups: tuple = ()

    @classmethod
    def one_per_prompt(cls, positions: torch.Tensor) -> Sites:
        """One site per prompt, at ``positions`` ``[batch]``."""
        return cls(torch.arange(positions.shape[0]), positions, int(positions.shape[0]))

    @classmethod
    def on(cls, rows: torch.Tensor, positions: torch.Tensor, batch: int, seq: int, groups: tuple = ()) -> Sites:
        """The sites with ``rows`` and ``positions`` already on the device the values are read on, and their flat
        index into ``[batch * seq, ...]`` (negative positions count from the end); ``groups``: ``Sites.grouped``."""
        flat = rows * seq + torch.where(positions < 0, positions + seq, positions)
        return cls(rows, positions, batch, flat, seq, groups)

    @staticmethod
    def grouped(rows: torch.Tensor, device) -> tuple:
        """``((prompt, index [k] on device), ...)``: the sites of each prompt in ``rows`` ``[n]`` (a host tensor),
        their indices copied to the device at once (one copy, before the forward pass reads anything)."""
        rows = rows.cpu()
        order = torch.argsort(rows, stable=True)
        prompts, counts = torch.unique_consecutive(rows[order], return_counts=True)
        on_device = order.to(device)
        starts = [0, *torch.cumsum(counts, 0).tolist()]
        return tuple((int(b), on_device[start:end]) for b, start, end in zip(prompts.tolist(), starts, starts[1:]))

    def __len__(self) -> int:
        return int(self.rows.shape[0])


def at(value: torch.Tensor, sites: Sites, keep: bool = False) -> torch.Tensor:
    """``[n, ...]``: ``value[rows, positions]`` at the sites, in float32 (a copy, so later in-place edits cannot reach
    it); ``keep``: in the value's own dtype (a product with a float32 tensor then reads it in float32 without a
    float32 copy of its own). A contiguous value is read as ``[batch * pos, ...]`` rows (``index_select``: the same
    copy as advanced indexing, bit for bit, in less than half its time on ``[batch, pos, d_mlp]``)."""
    if value.dim() < 2 or not value.is_contiguous():
        out = value[sites.rows.to(value.device), sites.positions.to(value.device)]
    else:
        width, flat = value.shape[1], sites.flat
        if flat is None or width != sites.seq or flat.device != value.device:
            rows, positions = sites.rows.to(value.device), sites.positions.to(value.device)
            flat = rows * width + torch.where(positions < 0, positions + width, positions)
        out = value.flatten(0, 1).index_select(0, flat)
    return out if keep else out.float()


def frozen_at(norm, sites: Sites, io: tuple | None = None) -> FrozenNorm:
    """A norm envoy frozen at its real input at the sites (reads its input, then its output; or takes them from
    ``io``, its whole ``(input, output)`` ``[batch, pos, d]`` already read)."""
    whole_in, whole_out = io if io is not None else (read_site(norm, "input", sites.batch), None)
    stream = at(whole_in, sites)
    probe = probe_norm(norm, stream.shape[-1])
    output = whole_out if whole_out is not None else read_site(norm, "output", sites.batch)
    return probe.freeze(stream, at(output, sites))


def param(layer, path: str) -> torch.Tensor:
    """The parameter (or buffer) at ``path`` below a block envoy, in float32."""
    return module_at(layer, path).float()


def find_term(model, i: int, name: str) -> Term:
    """The term named ``name`` that block ``i`` writes (raises a clear error if the block writes none)."""
    family = family_of(model)
    terms = layer_terms(family, model.layers[i])
    for term in terms:
        if term.name == name:
            return term
    raise InputError(
        f"block {i} of this {family.name} model writes no {name!r} term (it writes {', '.join(t.name for t in terms)})"
    )


def term_output(model, i: int, name: str, batch_size: int | None = None) -> torch.Tensor:
    """``[batch, pos, d_model]``: what the term ``name`` of block ``i`` adds to the residual stream.

    On a family whose module flattens batch and position (OPT's MLP) the value is ``[batch * pos, d_model]``
    unless ``batch_size`` is given.
    """
    term = find_term(model, i, name)
    multiplier = None if term.write.multiplier is None else scalar(term.write.multiplier, text_config(model), i)
    return term_write(model.layers[i], term, multiplier, batch_size)


def term_write(layer, term: Term, multiplier: float | None, batch_size: int | None = None) -> torch.Tensor:
    """``[batch, pos, d_model]``: what ``term`` adds to the stream below the block envoy ``layer``, its write's
    multiplier resolved to ``multiplier`` (None: none)."""
    value, write = read_site(layer, term.output, batch_size), term.write
    if write.clone:
        value = value.clone()
    if write.bias is not None:
        value = value + module_at(layer, write.bias)
    if write.scale is not None:
        value = value * module_at(layer, write.scale)
    if multiplier is not None:
        value = value * multiplier
    return value


def layer_input(model, i: int) -> torch.Tensor:
    """``[batch, pos, d_model]``: the residual stream entering block ``i`` (block 0: the embedding term)."""
    return model.layers[i].input


def layer_output(model, i: int) -> torch.Tensor:
    """``[batch, pos, d_model]``: the residual stream leaving block ``i``."""
    value = model.layers[i].output
    return value[0] if isinstance(value, (tuple, list)) else value


def attention_output(model, i: int) -> torch.Tensor:
    """``[batch, pos, d_model]``: what block ``i``'s attention adds to the residual stream."""
    return term_output(model, i, "attn")


def mlp_output(model, i: int, batch_size: int | None = None) -> torch.Tensor:
    """``[batch, pos, d_model]``: what block ``i``'s MLP adds to the residual stream (see ``term_output``)."""
    return term_output(model, i, "mlp", batch_size)


def attention_head_outputs(model, i: int) -> torch.Tensor:
    """``[batch, pos, heads, head_dim]``: block ``i``'s heads, the input of its attention output projection.

    A grouped projection's input (DeepSeek-V4's ``[batch, pos, groups, heads / groups * head_dim]``) is flattened
    first. A mixture of attention (JetMoE) routes each token to its own heads, so it has no such tensor: use
    ``attribute(..., by="head")``.
    """
    term = find_term(model, i, "attn")
    if isinstance(term.split, Routed):
        raise InputError(
            f"block {i}'s attention is a mixture of attention: each token's heads live in the experts it was routed "
            "to, grouped by expert, so there is no [batch, pos, heads, head_dim] tensor; use attribute(by='head')"
        )
    if not isinstance(term.split, Heads):
        raise InputError(
            f"block {i}'s attention does not split into heads in this family ({family_of(model).name}): "
            "its write is read as one term (see its notes in the family table, dla_recipes/families/)"
        )
    heads = int(getattr(model, "num_heads", None) or text_config(model).num_attention_heads)
    value = read_site(model.layers[i], f"{term.split.projection}.input")
    return value.flatten(2).unflatten(-1, (heads, -1))


def neuron_activations(model, i: int, batch_size: int | None = None) -> torch.Tensor:
    """``[batch, pos, d_mlp]``: block ``i``'s MLP neurons, the input of its down projection (see ``term_output``)."""
    term = find_term(model, i, "mlp")
    return read_site(model.layers[i], f"{getattr(term.split, 'projection', None)}.input", batch_size)
