"""The transport stage: moving batches. Tokenize and group the prompts (``batches``), run one trace per batch
locally or as one NDIF request (``run``), retry what is transient and name the cause of what is not (``remote``).
It never builds an ``Attribution``: it returns ``Readout``s.
"""
