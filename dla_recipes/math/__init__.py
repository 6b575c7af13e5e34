"""The math stage: tensors in, tensors out; it imports nothing of the package.

``frozen_norm`` (a norm turned into a linear map at the stream it really read: ``FrozenNorm``, ``probe_norm``),
``linalg`` (float32 products and pull-backs through projections), ``rounding`` (the model's own rounding, for the
self-check).
"""

from .frozen_norm import FrozenNorm, NormProbe, probe_norm

__all__ = ["FrozenNorm", "NormProbe", "probe_norm"]
