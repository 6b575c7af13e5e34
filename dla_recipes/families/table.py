"""The table itself: ``FAMILIES`` (the dense, experts and hybrid entries), ``REFUSED`` (model types no entry can
describe exactly yet, with the reason) and ``family_of``, which picks a model's entry by its config's
``model_type`` (the first entry listing it; no model type is listed twice)."""

from __future__ import annotations

from ..errors import UnknownFamilyError
from .dense import DENSE
from .experts import EXPERTS
from .hybrid import HYBRID
from .schema import Family

FAMILIES: tuple[Family, ...] = DENSE + EXPERTS + HYBRID

# Decoder model types dla_recipes knows and refuses: model type -> why no entry can be exact yet (what is missing).
# ``family_of`` raises ``UnknownFamilyError`` naming the reason; the generated families page lists them.
REFUSED: dict[str, str] = {
    "laguna": "its MoE multiplies the routed experts' sum by moe_routed_scaling_factor after the experts module and "
              "before adding the shared expert; the expert split has no term for that factor yet",
    "dots3_note_text": "its config gives the number of attention heads per layer (per_layer_config), which the "
                       "head split does not read yet",
    "longcat_flash": "each block holds two attention sublayers and two MLPs (ModuleLists) plus a shortcut MoE "
                     "added at the block's end, whose zero-computation (identity) experts add their input; no term "
                     "kind reads ModuleList sublayers or identity experts yet",
    # --- Refusals for the new term kinds (issue 12): decoder types whose writes no term kind describes exactly.
    "dory": "its recurrent section calls the same decoder layers n_loops times in one forward and re-adds the "
            "normed input section's output between loops, outside any block; its blocks replace the stream by an "
            "interpolation (1 - a) * norm(stream) + a * norm(write) and its lm_head scales each token's logit by a "
            "learned per-token factor: a block is not one call, so its terms cannot be read once each.",
    "gemma3n_text": "AltUp keeps several streams: each block predicts every stream from all of them with "
                    "coefficients computed from the stream, runs its sublayers on the active prediction (merging "
                    "attention with a LAuReL branch as (attn + laurel) / sqrt(2)), then corrects every stream by "
                    "coefficients times (the block's output minus the active prediction), so the stream itself re-"
                    "enters through what the block writes; the final collapse rescales each stream to the active "
                    "stream's magnitude (not linear in the streams).",
    "qwen4_exp_text": "its streams are collapsed by hyper_connection_mixer: a mean over the streams of each stream "
                      "RMS-normed on its own and gated channel by channel by an input-dependent sigmoid, so each "
                      "stream is read along its own direction; the parallel-stream kind reads every stream along one "
                      "direction with a scalar weight per stream (its gated residuals otherwise fit: the writes go "
                      "into every stream times injection_weights, like HY-V4).",
    "inkling2_text": "each sublayer reads a softmax-weighted mixture over all earlier blocks' outputs (block attention "
                     "residuals, input-dependent mixing over depth) and its output passes through a causal "
                     "convolution over positions: no term kind reads mixing over depth.",
    "inkling2_loop_text": "as inkling2_text (attention over earlier blocks' outputs, convolutions over positions), and "
                          "its blocks run in loops: no term kind reads mixing over depth.",
    "reformer": "reversible residual layers: attention writes one half-stream and the chunked feed-forward the other "
                "(y1 = x1 + attn(x2), y2 = x2 + ffn(y1)), and the final norm reads their concatenation "
                "(2 * hidden_size); no term kind describes two half-streams, and nnterp finds no layers.",
    "cpmant": "the model prepends prompt_length learned prompt tokens (and a segment embedding) inside its forward, "
              "so its blocks run on a longer sequence than the input and an attributed position is a different "
              "index inside them; its blocks add the residual inside their attention and FFN sub-blocks.",
}


def text_config(model_or_config):
    """The text config of a model (a StandardizedTransformer, an envoy, a transformers model: its ``.config``) or of
    a config: its ``text_config`` where it has one (multimodal configs), else the config itself."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "text_config", None) or config


def family_of(model_or_config) -> Family:
    """The ``Family`` entry for a model (a StandardizedTransformer, a transformers model) or its config."""
    config = text_config(model_or_config)
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type in REFUSED:
        raise UnknownFamilyError(
            f"dla_recipes refuses model_type {model_type!r}: {REFUSED[model_type]}. It cannot promise exact "
            "attributions for it, so it returns none."
        )
    known = ", ".join(sorted(t for f in FAMILIES for t in f.model_types))
    raise UnknownFamilyError(
        f"dla_recipes has no family entry for model_type {model_type!r} ({type(model_or_config).__name__}). "
        f"Known model types: {known}. To add one, describe what its blocks add to the residual stream as a "
        "`Family` entry in the right group file of dla_recipes/families/ (dense.py, experts.py or hybrid.py; usually "
        "one line: see the package docstring) and add a tiny model for it in dla_recipes/testing/tiny/; the test "
        "suite then checks it against the model's own logits."
    )
