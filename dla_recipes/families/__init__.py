"""The family table: every per-family fact dla_recipes uses, as data, in this one package.

The attribution math (``dla_recipes.trace``) never asks which family it runs on. It asks this table three questions, and
each family answers with one ``Family`` entry:

1. **What does each block add to its residual stream?** A tuple of ``Term``: where the added tensor is read
   (``output``), how it splits (``split``: ``Heads`` / ``Neurons`` at a linear map's input, ``projection``;
   ``Experts`` / ``Routed`` mixtures of experts), and how it is scaled (``write``, a ``Write``: a norm between that
   map and the add, ``post_norm``; a config multiplier, ``multiplier``; an affine merge, ``scale``, ``bias``).
2. **What acts on the stream itself after a term is written?** ``Term.stream`` (a ``Stream``): ``scale`` /
   ``bias`` (the stream is ``(stream + bias) * scale`` when the term is added, as on Doge and ZAYA), ``multiplier``
   (a scalar, MiniMax's alpha), ``norm`` / ``norm_after`` (a norm applied to the stream itself before / right after
   the add: MiniMax, RWKV's block 0, OpenAI GPT's post-norm blocks); and ``Family.layer_scale`` (the whole stream
   times a per-block buffer after the block, as on Gemma-4).
3. **What does the final head apply after the final norm and ``lm_head``?** ``logits_times`` / ``logits_over`` (a
   config constant) and ``softcap`` (``c * tanh(z / c)``: not linear, so the parts sum to the pre-cap logit);
   ``head_input_over`` (lm_head reads the final norm's output over a config constant) and ``final_norm`` (``"none"``:
   no final norm; ``"shared"``: the final norm module also runs before the blocks).

Paths are relative to the block envoy (``model.layers[i]``) in nnterp's renamed vocabulary (``self_attn``, ``mlp``),
with native names below that. The table composes: a term with ``when`` (``unless``) is written only by blocks where
that path exists (does not exist), so one list of optional terms describes every combination of a family's features
(Gemma-4's dense MLP, experts and per-layer inputs). An entry may also hold several layer kinds (hybrids whose blocks
share nothing); the first kind whose ``when`` path exists on a block is that block's kind.

A mixture of experts is recomputed from its own routing and weights; ``ExpertsLayout`` says how its experts module
stores them (fused or separate gate/up, ``[out, in]`` or ``[in, out]``, biases, the module's own gating function,
router-scaled inputs, scaled routed and shared parts).

Adding a family: one ``Family`` entry in the right group file (``dense.py``, ``experts.py`` or ``hybrid.py``;
shapes shared by several entries are in ``shapes.py``) and one tiny model in ``dla_recipes.testing.tiny``; the
test suite then checks it for exactness against the model's own logits at every granularity, and checks that a
family declared ``padding_safe`` really is (its padded batch's logits against each prompt alone). A model that runs
a long sequence chunk by chunk (xLSTM) names the config value of its limit in ``single_pass``: a longer batch is
refused, since no trace reads one pass of its blocks. A model type that no entry can describe exactly yet goes in
``REFUSED`` (``table.py``) with the reason, which ``family_of`` raises.
The docs page "Family table" is generated from this package (``notebooks/families_table.py``).

Modules: ``schema.py`` (the dataclasses: ``Term`` and its records ``Write``, ``Stream``, ``Heads``, ``Neurons``,
``Experts``, ``Routed``), ``shapes.py`` (shared shapes, computed scalars), ``dense.py`` /
``experts.py`` / ``hybrid.py`` (the entries, ``DENSE`` / ``EXPERTS`` / ``HYBRID``), ``table.py`` (``FAMILIES``,
``REFUSED``, ``family_of``, ``text_config``). ``family_of`` reads ``table.FAMILIES``: a test that swaps in an
entry patches ``dla_recipes.families.table.FAMILIES``.
"""

from . import table
from .schema import (
    FUSED,
    Experts,
    ExpertsLayout,
    Family,
    Heads,
    LayerKind,
    Neurons,
    Routed,
    Split,
    Stream,
    Term,
    Write,
)
from .table import FAMILIES, REFUSED, family_of, text_config

__all__ = [
    "FAMILIES", "FUSED", "REFUSED", "Experts", "ExpertsLayout", "Family", "Heads", "LayerKind", "Neurons", "Routed",
    "Split", "Stream", "Term", "Write", "family_of", "table", "text_config",
]
