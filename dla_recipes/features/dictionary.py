"""A prepared dictionary (an SAE or a transcoder) as a typed record, and the adapter that builds one from what a user has.

``Dictionary`` holds the decoder (``W_dec [d_sae, d_out]``, ``b_dec [d_out]``, a skip transcoder's ``W_skip
[d_out, d_in]``), how the latents are computed (an ``Encoder``: ``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, an
activation kind with its threshold or ``k``; or, for local runs only, any callable ``x [n, d_in] -> a [n, d_sae]``)
and what it reads (``"output"``: the term it splits, an SAE; ``"input"``: what the term's sublayer reads, a
transcoder). ``as_dictionary`` accepts a ``Dictionary`` as it is, or any object shaped like sae-lens's ``SAE`` /
``JumpReLUSAE`` / ``TopKSAE`` / ``Transcoder`` / ``SkipTranscoder`` / ``JumpReLUTranscoder`` (duck-typed: ``W_dec``,
``b_dec``, ``W_enc``, ``b_enc``, ``threshold``, ``W_skip``, ``cfg``), never importing sae-lens. The latents come
from the weights when the architecture is known for sure (sae-lens's ``cfg.architecture()``, one of
``ARCHITECTURES``); otherwise from the object's own ``encode`` where it has one (a guess from the weights could run
a TopK whose ``k`` lives elsewhere as a ReLU, and the sum would still be exact), else from the weights with the
activation its attributes say (``threshold``: JumpReLU; ``k`` or ``cfg.k``: TopK; neither: ReLU). Its problems
are returned as messages (``problems``), so that ``features.attach`` reports every dictionary's at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

ACTIVATIONS = ("relu", "jumprelu", "topk")
KEEP = 256  # latents a site sends back by default (the largest parts; ``Dictionary.keep`` sets it per dictionary)
ARCHITECTURES = {  # sae-lens's cfg.architecture(): (activation, reads)
    "standard": ("relu", "output"), "jumprelu": ("jumprelu", "output"), "topk": ("topk", "output"),
    "transcoder": ("relu", "input"), "skip_transcoder": ("relu", "input"),
    "jumprelu_transcoder": ("jumprelu", "input"), "jumprelu_skip_transcoder": ("jumprelu", "input"),
}
_HOOK = re.compile(r"^blocks\.(\d+)\.(hook_resid_pre|hook_resid_post|hook_mlp_out|hook_mlp_in|ln2\.hook_normalized|"
                   r"hook_attn_out|hook_resid_mid|attn\.hook_z)$")


@dataclass(frozen=True, eq=False)
class Encoder:
    """The latents of an input row ``x`` ``[d_in]``: ``activation((x - b_in) @ W_enc + b_enc)`` ``[d_sae]``.

    Attributes:
        W_enc: ``[d_in, d_sae]``; b_enc: ``[d_sae]``.
        activation: ``"relu"``; ``"jumprelu"`` (``relu(pre) * (pre > threshold)``); ``"topk"`` (the ``k`` largest
            pre-activations, then relu, the rest 0), as sae-lens computes them.
        threshold: ``[d_sae]`` (jumprelu); k: the active count (topk).
        b_in: ``[d_in]`` subtracted from the input first (sae-lens's ``apply_b_dec_to_input``: its ``b_dec``), or None.
    """

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    activation: Literal["relu", "jumprelu", "topk"] = "relu"
    threshold: torch.Tensor | None = None
    k: int | None = None
    b_in: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, d_sae]`` the latents of ``x`` ``[n, d_in]`` (float32 in, float32 out)."""
        if self.b_in is not None:
            x = x - self.b_in
        pre = x @ self.W_enc + self.b_enc
        if self.activation == "jumprelu":
            return pre.relu() * (pre > self.threshold).to(pre.dtype)
        if self.activation == "topk":
            top = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, top.indices, top.values.relu())
        return pre.relu()

    def tensors(self) -> dict:
        """Its weights by name (the ones it has)."""
        named = {"W_enc": self.W_enc, "b_enc": self.b_enc, "threshold": self.threshold, "b_in": self.b_in}
        return {k: v for k, v in named.items() if v is not None}

    def to(self, **kwargs) -> Encoder:
        moved = {k: v.to(**kwargs) for k, v in self.tensors().items()}
        return Encoder(moved["W_enc"], moved["b_enc"], self.activation, moved.get("threshold"), self.k,
                       moved.get("b_in"))


@dataclass(frozen=True, eq=False)
class Dictionary:
    """A dictionary ready to split one term (or the stream): see the module docstring.

    Attributes:
        W_dec: ``[d_sae, d_out]``; b_dec: ``[d_out]``.
        encoder: an ``Encoder``, or a callable ``x [n, d_in] -> latents [n, d_sae]`` (local runs only: a callable
            cannot travel to a remote server).
        W_skip: ``[d_out, d_in]`` a skip transcoder's linear path, or None.
        reads: ``"output"``: the latents are read from what the term writes (an SAE); ``"input"``: from what the
            term's sublayer reads, after its norm (a transcoder).
        hook: the hook point the dictionary's own config names (sae-lens's ``cfg.metadata.hook_name``:
            ``"blocks.12.hook_mlp_out"``), checked against the key it is given under (``site_of_hook``).
        keep: how many latents' parts a site sends back (the largest by size; the others summed in
            ``L12.mlp.dropped``); None: a TopK encoder's ``k``, else ``min(d_sae, KEEP)`` (``kept``).
    """

    W_dec: torch.Tensor
    b_dec: torch.Tensor
    encoder: Encoder | Callable
    W_skip: torch.Tensor | None = None
    reads: Literal["output", "input"] = "output"
    hook: str | None = None
    keep: int | None = None

    @property
    def width(self) -> int:
        """``d_sae``: how many latents."""
        return int(self.W_dec.shape[0])

    @property
    def kept(self) -> int:
        """How many latents' parts a site sends back: ``keep``, a TopK encoder's ``k``, or ``min(d_sae, KEEP)``."""
        if self.keep is not None:
            return min(int(self.keep), self.width)
        k = self.encoder.k if isinstance(self.encoder, Encoder) and self.encoder.activation == "topk" else None
        return min(int(k) if k else KEEP, self.width)

    def tensors(self) -> dict:
        """Every weight that travels with it, by name."""
        named = {"W_dec": self.W_dec, "b_dec": self.b_dec, "W_skip": self.W_skip}
        named = {k: v for k, v in named.items() if v is not None}
        return named | (self.encoder.tensors() if isinstance(self.encoder, Encoder) else {})

    def nbytes(self) -> int:
        """The bytes of its weights (what a remote request carries for it)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, **kwargs) -> Dictionary:
        """A copy with every weight moved (``device=``, ``dtype=``)."""
        encoder = self.encoder.to(**kwargs) if isinstance(self.encoder, Encoder) else self.encoder
        return Dictionary(self.W_dec.to(**kwargs), self.b_dec.to(**kwargs), encoder,
                          W_skip=None if self.W_skip is None else self.W_skip.to(**kwargs), reads=self.reads,
                          hook=self.hook, keep=self.keep)


def site_of_hook(name) -> str | None:
    """The key a TransformerLens / sae-lens hook name stands for (``"blocks.12.hook_mlp_out"`` -> ``"L12.mlp"``,
    ``hook_resid_pre`` -> ``"L12.resid"``, ``hook_resid_post`` -> the next block's ``resid``); ``"?..."`` for a
    hook that is no term or block boundary (``hook_resid_mid``, ``attn.hook_z``); None when not a hook name."""
    match = _HOOK.match(name) if isinstance(name, str) else None
    if match is None:
        return None
    layer, hook = int(match.group(1)), match.group(2)
    if hook in ("hook_resid_mid", "attn.hook_z"):
        return f"?{name}"
    if hook == "hook_resid_post":
        return f"L{layer + 1}.resid"
    return f"L{layer}." + ("attn" if hook == "hook_attn_out" else "resid" if hook == "hook_resid_pre" else "mlp")


def _tensor(obj, name):
    value = getattr(obj, name, None)
    return value.detach() if isinstance(value, torch.Tensor) else None


def as_dictionary(obj, key: str) -> tuple[Dictionary | None, list[str]]:
    """``(dictionary, problems)``: ``obj`` as a ``Dictionary`` (itself, or read from an sae-lens-shaped object),
    or None and what is wrong with it (each problem one message naming ``key``)."""
    if isinstance(obj, Dictionary):
        return obj, []
    W_dec, b_dec = _tensor(obj, "W_dec"), _tensor(obj, "b_dec")
    if W_dec is None or b_dec is None:
        kind = type(obj).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        return None, [(f"{key}: {article} {kind} is not a dictionary: give an sae-lens SAE / Transcoder (or any "
                      "object with W_dec [d_sae, d_out], b_dec and encode / W_enc, b_enc) or a "
                      "dla_recipes.features.Dictionary")]
    cfg = getattr(obj, "cfg", None)
    architecture = cfg.architecture() if callable(getattr(cfg, "architecture", None)) else None
    problems = []
    if architecture is not None and architecture not in ARCHITECTURES:
        problems.append(f"{key}: sae-lens architecture {architecture!r} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES)})")
    normalize = getattr(cfg, "normalize_activations", "none")
    if normalize not in (None, "none"):
        problems.append(f"{key}: normalize_activations={normalize!r} rescales the input at run time; fold it into "
                        "the weights first (sae-lens: sae.fold_activation_norm_scaling_factor(...)) or give "
                        "normalize_activations='none'")
    if getattr(cfg, "reshape_activations", "none") not in (None, "none"):
        problems.append(f"{key}: an SAE on attention's hook_z (per-head values) reads no term's write; use one on "
                        "hook_attn_out (key 'L<i>.attn')")
    if getattr(cfg, "rescale_acts_by_decoder_norm", False):
        problems.append(f"{key}: rescale_acts_by_decoder_norm=True is not supported (fold the decoder norms first)")
    activation, reads = ARCHITECTURES.get(architecture, (None, None))
    W_skip = _tensor(obj, "W_skip")
    if reads is None:
        reads = "input" if W_skip is not None or "transcoder" in type(obj).__name__.lower() else "output"
    W_enc, b_enc, threshold = _tensor(obj, "W_enc"), _tensor(obj, "b_enc"), _tensor(obj, "threshold")
    k = getattr(cfg, "k", None) if architecture == "topk" else getattr(obj, "k", getattr(cfg, "k", None))
    own_encode = callable(getattr(obj, "encode", None))
    if activation is None and own_encode:  # the architecture is not known for sure: the object's own encode, never
        encoder = obj.encode  # a guess from its weights (a TopK whose k is elsewhere would be run as a ReLU)
    elif W_enc is not None and b_enc is not None:
        if activation is None:
            activation = "jumprelu" if threshold is not None else "topk" if isinstance(k, int) else "relu"
        b_in = b_dec if reads == "output" and getattr(cfg, "apply_b_dec_to_input", False) else None
        encoder = Encoder(W_enc, b_enc, activation, threshold if activation == "jumprelu" else None,
                          int(k) if activation == "topk" and k is not None else None, b_in)
        if activation == "topk" and encoder.k is None:
            problems.append(f"{key}: a TopK dictionary needs its k (cfg.k)")
    elif own_encode:
        encoder = obj.encode
    else:
        return None, problems + [f"{key}: {type(obj).__name__} has W_dec and b_dec but neither W_enc / b_enc nor encode"]
    metadata = getattr(cfg, "metadata", None)
    hook = getattr(metadata, "hook_name", None) or getattr(cfg, "hook_name", None)
    return Dictionary(W_dec, b_dec, encoder, W_skip, reads, hook if isinstance(hook, str) else None), problems
