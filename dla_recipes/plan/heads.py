"""Where one attention head's output lives: ``head_slice(model, layer, head)``, for editing a head in nnsight.

A head's part (``L3.H5`` at ``by="head"``) is its slice of the input of the attention's output projection, read the
way the plan reads it: ``projection.input`` ``[batch, pos, heads * head_dim]`` split into ``Plan.num_heads`` pieces of
``PlannedTerm.part_width`` features. That width is the projection's own (``o_proj.in_features / heads``), which is
not ``hidden_size // num_heads`` on every model (Gemma-3-270M: 640 // 4 = 160, its heads are 256 wide), nor the
query width on latent attention (MLA: ``v_head_dim``). On a grouped projection (DeepSeek-V4's ``o_a_proj``) the input
is ``[batch, pos, groups, in / groups]`` and a head is a slice of one group. Zeroing the slice makes the head's part
exactly 0 (at every position where the head is zeroed)::

    hs = dla_recipes.head_slice(model, 3, 5)
    def ablate(m):
        hs.site(m).input[hs.index] = 0    # m.layers[3].self_attn.o_proj.input[..., 80:96] = 0 (on a 16-wide head)
    dla_recipes.attribute(model, prompt, " Paris", by="head", intervene=ablate)

Heads routed to experts (a mixture of attention, JetMoE's ``Routed`` split) are no slice of one tensor: each token's
heads are rows of the experts it was routed to, grouped by expert; ``head_slice`` refuses them, as it refuses a
block whose attention does not split into heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..families import Routed
from .build import build_plan, module_at


@dataclass(frozen=True)
class HeadSlice:
    """Head ``head`` of block ``layer``: which features of which module's input are its output.

    Attributes:
        layer, head: the block and the head (non-negative), as in the label ``L{layer}.H{head}``.
        projection: the output projection's path below the block (``"self_attn.o_proj"``, GPT-2's
            ``"self_attn.c_proj"``, DeepSeek-V4's ``"self_attn.o_a_proj"``).
        columns: the head's features in the last dimension of the projection's input, ``slice(start, stop)``.
        group: on a grouped projection (input ``[batch, pos, groups, in / groups]``), the group the head is in;
            None: the input is ``[batch, pos, heads * head_dim]``.
    """

    layer: int
    head: int
    projection: str
    columns: slice
    group: int | None = None

    @property
    def module(self) -> str:
        """The projection's path from the model: ``"layers[3].self_attn.o_proj"``."""
        return f"layers[{self.layer}].{self.projection}"

    @property
    def index(self) -> tuple:
        """What indexes the head's features in the projection's input (any leading dimensions kept):
        ``(..., columns)``, or ``(..., group, columns)`` on a grouped projection. ``x[:, -1][hs.index]`` is the
        head at the last position."""
        return (Ellipsis, self.columns) if self.group is None else (Ellipsis, self.group, self.columns)

    @property
    def width(self) -> int:
        """The head's width in features (``head_dim``; ``v_head_dim`` on latent attention)."""
        return self.columns.stop - self.columns.start

    def site(self, model):
        """The projection's envoy (or module) in ``model``: ``model.layers[layer].<projection>``; inside a trace,
        ``hs.site(m).input[hs.index] = 0`` zeroes the head."""
        return module_at(model.layers[self.layer], self.projection)


def head_slice(model, layer: int, head: int) -> HeadSlice:
    """Where head ``head`` of block ``layer`` of ``model`` writes: its ``HeadSlice`` (projection, columns, group).

    ``layer`` and ``head`` may be negative (counted from the end). Raises ``InputError`` when the block's attention
    does not split into heads in its family, when its heads are routed to experts (no slice of one tensor), or when
    ``layer`` / ``head`` is out of range.
    """
    plan = build_plan(model)
    layers = len(plan.layers)
    if not -layers <= layer < layers:
        raise InputError(f"layer {layer} is outside this {layers}-block model")
    layer %= layers
    terms = plan.layers[layer]
    split_terms = [planned for planned in terms if planned.term.splits_heads and planned.parts]
    if not split_terms:
        raise InputError(
            f"block {layer} of this {plan.family.name} model has no attention heads to slice: its terms "
            f"({', '.join(planned.term.name for planned in terms)}) do not split into heads in the family table"
        )
    planned = split_terms[0]
    split = planned.term.split
    if isinstance(split, Routed):
        raise InputError(
            f"block {layer}'s attention ({plan.family.name}) is a mixture of attention: each token's heads are rows "
            f"of the experts it was routed to ({split.projection}'s input is [routed rows, features], grouped by "
            "expert), so no slice of one tensor is head "
            f"{head}; edit the routing or the experts' output instead"
        )
    heads, width = planned.parts, planned.part_width
    if not -heads <= head < heads:
        raise InputError(f"head {head} is outside block {layer}'s {heads} heads")
    head %= heads
    start = head * width
    groups = int(getattr(module_at(model.layers[layer], split.projection)._module, "n_groups", 1) or 1)
    if groups == 1:
        return HeadSlice(layer, head, split.projection, slice(start, start + width))
    per_group = heads * width // groups  # the input is [batch, pos, groups, per_group]
    if per_group % width:
        raise InputError(  # no family has it; a head across two groups would be no slice of one
            f"block {layer}'s {split.projection} has {groups} groups of {per_group} features, not a whole number "
            f"of {width}-wide heads: head {head} is no slice of one group"
        )
    return HeadSlice(layer, head, split.projection, slice(start % per_group, start % per_group + width),
                     start // per_group)
