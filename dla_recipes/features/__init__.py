"""Dictionary features: attribution to the latents of SAEs and transcoders, as one more split of a term.

``attribute(model, prompts, target, dictionaries={"L12.mlp": sae, "L3.attn": sae2, "L8.mlp": transcoder,
"L16.resid": sae3})`` splits each keyed term into its dictionary's latents; every other term keeps the granularity of
``by=``. For a term with direction ``u`` (the logit's direction pulled back through every later map and the frozen
norms, as for any term) and a dictionary with latents ``a = encode(x)``:

- ``L12.mlp.F1234``: ``a_i * (W_dec[i] @ u)``, one column per latent (0 where it is inactive or not kept);
- ``L12.mlp.dropped``: the sum of the latents' parts not among the ``k`` kept at the site (below);
- ``L12.mlp.bias``: ``b_dec @ u``; ``L12.mlp.skip``: a skip transcoder's ``(W_skip x) @ u``;
- ``L12.mlp.error``: what the term really wrote, along ``u``, minus the reconstruction along ``u``;
- ``L12.mlp``: what the term's write adds besides (a bias of the write itself, where the family has one; else 0);

so the parts still sum to the model's own logit and the self-check holds them. An SAE reads what the term writes
(after a post-norm, on Gemma-2/3 and OLMo-2: what is added to the stream, as TransformerLens's ``hook_mlp_out``);
a transcoder reads what the term's sublayer reads (its norm's output: ``ln2`` / ``pre_feedforward_layernorm``) and
stands for what the term writes (after the post-norm where there is one: a transcoder trained on the MLP's own
output, before its post-norm, leaves that norm's work in its error term). A transcoder on a sublayer that reads
the stream through no norm (OLMo-2's MLP, whose only norm is after it) is refused. ``L16.resid`` splits the stream entering
block 16: its parts replace the embedding and every term written before block 16 (whose sum that stream is), and
the later blocks stay components; they are the stream's *direct* path through the frozen final norm, not what it
does through the later blocks (which is in those blocks' parts). A term dictionary before a residual one, two
residual ones, and a residual one on a family that acts on the stream between blocks are refused.

In the trace every latent is a column, an inactive one exactly 0 (as every neuron is at ``by="neuron"``): only
``[sites, d_sae]`` is built (``W_dec @ u`` once per call and term, never ``[sites, d_sae, d_model]``). What leaves
the trace is sparse (``trace.sparse``): per dictionary and site the ``k`` parts of largest ``|part|`` (values and
latent indices, ``torch.topk``), ``k`` fixed before the forward pass (a TopK encoder's ``k``, else ``min(d_sae,
256)``; ``Dictionary(keep=...)`` sets it), and the sum of the others in ``L12.mlp.dropped`` (0 where ``k`` holds
every active latent: then the kept parts are the dense columns bit for bit), so the parts still sum exactly. The
client scatters the kept parts back into the same columns (an unkept latent reads 0): labels, ``top()``,
``to_frame()``, ``blocks()`` and ``position="all"`` see one fixed set of columns and the trace reads no count on
the host; ``reduce="stats"`` reduces the dense columns in the trace. Remotely the dictionary's weights travel
inside the request, once per NDIF session, and a dictionary (or all of them) over ``REQUEST_LIMIT`` bytes is
refused before anything is sent.

``Dictionary`` / ``Encoder`` (``features.dictionary``) are the typed records; sae-lens objects are read as they are
(``as_dictionary``); ``attach`` (``features.bind``) checks every dictionary against the model at once.
"""

from .bind import REQUEST_LIMIT, attach
from .dictionary import Dictionary, Encoder, as_dictionary

__all__ = ["REQUEST_LIMIT", "Dictionary", "Encoder", "as_dictionary", "attach"]
