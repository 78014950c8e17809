"""The test models, in one place.

- :mod:`.pipeline`: a model family for the schedules (trainable, frozen or no preprocess, any
  number of stages, an integer-token entry) with a non-pipelined reference;
- :mod:`.kernel`: single cells for the kernel and executor tests (tuple inputs and outputs, an
  integer input, a loss stage) with their own reference;
- :mod:`.common`: what both share: the tolerance of every comparison with a reference, the loss,
  parameter naming.

The two families keep their own sizes: the tests' expected shapes and compile counts are written
for them.
"""
