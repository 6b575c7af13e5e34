"""Tiny random decoder models, one per supported family, for tests, notebooks and benchmarks.

Every model here is built from a ``transformers`` Config class in milliseconds (no hub, no download): 2-3 layers,
hidden size 64, 4 attention heads (2 key/value heads where the family has GQA), intermediate size 128, vocabulary
128, float32, eval mode. Random initialisation hides bugs: norm gains start at exactly 1 (or 0 for ``1 + w``
norms), biases at 0, residual gates at 1, so a formula that forgets a gain or a bias still matches. ``perturb``
therefore moves every parameter or floating buffer whose values are all equal to random values away from its
init, and the config builders set every multiplier / soft-cap the family has to a non-trivial value.

Public API::

    FAMILIES                  # the family keys, in a fixed order
    tokenizer(vocab_size)     # offline WordLevel tokenizer "w0".."wN" + [UNK] + [PAD], left padding
    config(family)            # the tiny transformers Config
    build(family, seed=0)     # tiny perturbed transformers model (eval, float32)
    perturb(model, seed)      # the perturbation, in place
    standardized(family, seed=0)  # dla_recipes.load(build(family), tokenizer=tokenizer()) on CPU

Modules: ``base`` (the shared sizes, the tokenizer, ``llama_like``), ``dense`` / ``experts`` / ``hybrid`` (the
config builders of the dense, mixture-of-experts and hybrid / recurrent families), ``shaped`` (the families built
from their ``AutoConfig`` and shared shapes), ``registry`` (``FAMILIES``, ``config``, ``build``, ``perturb``,
``standardized``).

``import dla_recipes`` (done by ``registry``) must precede ``import nnterp``: it installs the nnsight-0.8 shim.
"""

from .base import VOCAB, llama_like, tokenizer
from .registry import FAMILIES, build, config, perturb, standardized
from .shaped import SHAPED_FAMILIES

__all__ = [
    "FAMILIES",
    "SHAPED_FAMILIES",
    "VOCAB",
    "build",
    "config",
    "llama_like",
    "perturb",
    "standardized",
    "tokenizer",
]
