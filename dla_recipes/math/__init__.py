"""The math stage: tensors in, tensors out, imports nothing of the package.

``frozen_norm`` (a norm turned into a linear map at the stream it really read), ``linalg`` (float32 products and
pull-backs through projections), ``rounding`` (the model's own rounding, for the self-check).
"""
